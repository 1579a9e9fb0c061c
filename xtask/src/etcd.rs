//! A real etcd (Debian's `etcd-server`) for the runs that meet through one:
//! on 127.0.0.1, in a data directory of its own under `target/`, killed
//! and removed on drop.

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::{Result, root};

pub struct Etcd {
    child: Child,
    dir: PathBuf,
    port: u16,
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?.local_addr().map_err(|e| e.to_string())?.port())
}

impl Etcd {
    /// Starts one and waits until it listens.
    pub fn start() -> Result<Etcd> {
        let (port, peer) = (free_port()?, free_port()?);
        let dir = root().join(format!("target/etcd-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let client = format!("http://127.0.0.1:{port}");
        let peer = format!("http://127.0.0.1:{peer}");
        let child = Command::new("etcd")
            .args(["--name", "xtask", "--data-dir"])
            .arg(&dir)
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("xtask={peer}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("starting etcd (Debian's etcd-server; ./x setup installs it): {e}"))?;
        let etcd = Etcd { child, dir, port };
        let until = Instant::now() + Duration::from_secs(30);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if Instant::now() >= until {
                return Err(format!("etcd did not listen on {} within 30 s", etcd.endpoint()));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        println!("xtask: etcd {} listening (data in {})", etcd.endpoint(), etcd.dir.display());
        Ok(etcd)
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
