//! A real etcd server (Debian's `etcd-server`) for the tests that need
//! one: on 127.0.0.1, in a data directory of its own, stopped on drop.
//!
//! The tests of one binary run in parallel, each with a server of its own,
//! and a server may be stopped and restarted on its ports. So ports are
//! picked among those no live server of this process holds, and a server
//! counts as up only when its own log says it serves on its own port: a
//! TCP connect alone could reach another test's server. A server that
//! could not bind (another process took the port between the pick and the
//! bind) is started again on fresh ports.

use std::collections::BTreeSet;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub struct EtcdServer {
    child: Option<Child>,
    dir: PathBuf,
    log: PathBuf,
    client_port: u16,
    peer_port: u16,
}

/// The ports held by this process's servers, running or stopped.
static HELD: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());

/// A port free now and held by none of this process's servers; it is
/// marked held until [`release`].
fn pick_port() -> u16 {
    let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        if held.insert(port) {
            return port;
        }
    }
}

fn release(ports: &[u16]) {
    let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
    for p in ports {
        held.remove(p);
    }
}

/// The etcd binary: `ETCD` or Debian's. Missing is a failure, not a skip.
fn binary() -> PathBuf {
    let path = PathBuf::from(std::env::var("ETCD").unwrap_or_else(|_| "/usr/bin/etcd".into()));
    assert!(path.exists(), "{} is missing: install Debian's etcd-server (./x setup does)", path.display());
    path
}

/// How a start ended.
enum Start {
    Up,
    /// The child exited before it served: its log's last lines.
    Exited(String),
}

impl EtcdServer {
    /// Starts a fresh server and waits until it answers.
    pub fn start() -> EtcdServer {
        let (client_port, peer_port) = (pick_port(), pick_port());
        let dir = std::env::temp_dir().join(format!("gpu-rdma-etcd-{}-{client_port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let log = dir.with_extension("log");
        let mut s = EtcdServer { child: None, dir, log, client_port, peer_port };
        let mut tries = 0;
        loop {
            tries += 1;
            match s.spawn() {
                Start::Up => return s,
                Start::Exited(tail) if tries == 6 => panic!("etcd did not start in six tries; its log ends:\n{tail}"),
                Start::Exited(_) => {
                    // Taken between the pick and the bind: new ports.
                    release(&[s.client_port, s.peer_port]);
                    (s.client_port, s.peer_port) = (pick_port(), pick_port());
                    let _ = std::fs::remove_dir_all(&s.dir);
                }
            }
        }
    }

    fn spawn(&mut self) -> Start {
        let client = format!("http://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::File::create(&self.log).expect("create the etcd log");
        let child = Command::new(binary())
            .args(["--name", "test", "--data-dir"])
            .arg(&self.dir)
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("test={peer}")])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start etcd");
        let child = self.child.insert(child);
        // etcd 3.4 logs this line once its client listener accepts.
        let serving = format!("serving insecure client requests on 127.0.0.1:{}", self.client_port);
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            let text = std::fs::read_to_string(&self.log).unwrap_or_default();
            if let Ok(Some(_)) = child.try_wait() {
                self.child = None;
                let tail: Vec<&str> = text.lines().rev().take(5).collect();
                return Start::Exited(tail.into_iter().rev().collect::<Vec<_>>().join("\n"));
            }
            if text.contains(&serving) {
                return Start::Up;
            }
            assert!(Instant::now() < until, "etcd did not serve within 30 s; its log:\n{text}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// Kills the server (its data and its ports stay).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same ports and data.
    pub fn restart(&mut self) {
        self.stop();
        if let Start::Exited(tail) = self.spawn() {
            panic!("etcd did not restart on port {}; its log ends:\n{tail}", self.client_port);
        }
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.stop();
        release(&[self.client_port, self.peer_port]);
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = std::fs::remove_file(&self.log);
    }
}
