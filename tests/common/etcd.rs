//! A real etcd server (Debian's `etcd-server`) for the tests that need
//! one: on 127.0.0.1, in a data directory of its own, stopped on drop.

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct EtcdServer {
    child: Option<Child>,
    dir: PathBuf,
    client_port: u16,
    peer_port: u16,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// The etcd binary: `ETCD` or Debian's. Missing is a failure, not a skip.
fn binary() -> PathBuf {
    let path = PathBuf::from(std::env::var("ETCD").unwrap_or_else(|_| "/usr/bin/etcd".into()));
    assert!(path.exists(), "{} is missing: install Debian's etcd-server (./x setup does)", path.display());
    path
}

impl EtcdServer {
    /// Starts a fresh server and waits until it answers.
    pub fn start() -> EtcdServer {
        let dir = std::env::temp_dir().join(format!("gpu-rdma-etcd-{}-{}", std::process::id(), free_port()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut s = EtcdServer { child: None, dir, client_port: free_port(), peer_port: free_port() };
        s.spawn();
        s
    }

    fn spawn(&mut self) {
        let client = format!("http://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let child = Command::new(binary())
            .args(["--name", "test", "--data-dir"])
            .arg(&self.dir)
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("test={peer}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start etcd");
        self.child = Some(child);
        let until = Instant::now() + Duration::from_secs(30);
        while TcpStream::connect(("127.0.0.1", self.client_port)).is_err() {
            assert!(Instant::now() < until, "etcd did not listen within 30 s");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// Kills the server (its data stays).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same ports and data.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
