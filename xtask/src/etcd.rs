//! A real etcd (Debian's `etcd-server`) for the runs that meet through one:
//! on 127.0.0.1, in a data directory of its own under `target/`, killed
//! and removed on drop.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::{Result, root};

pub struct Etcd {
    child: Child,
    dir: PathBuf,
    log: PathBuf,
    port: u16,
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?.local_addr().map_err(|e| e.to_string())?.port())
}

impl Etcd {
    /// Starts one and waits until it serves. It counts as up when its own
    /// log says it serves on its port (a connect could reach another
    /// process's listener there); one that exits first, having lost its
    /// ports to another process between the pick and the bind, is started
    /// again on fresh ones.
    pub fn start() -> Result<Etcd> {
        let mut last = String::new();
        for _ in 0..5 {
            match Etcd::try_start()? {
                Ok(etcd) => {
                    println!("xtask: etcd {} serving (data in {})", etcd.endpoint(), etcd.dir.display());
                    return Ok(etcd);
                }
                Err(tail) => last = tail,
            }
        }
        Err(format!("etcd did not start in five tries; its log ends:\n{last}"))
    }

    /// The server, or the end of its log when it exited before serving.
    fn try_start() -> Result<std::result::Result<Etcd, String>> {
        let (port, peer) = (free_port()?, free_port()?);
        let dir = root().join(format!("target/etcd-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let log = dir.with_extension("log");
        let stderr = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let client = format!("http://127.0.0.1:{port}");
        let peer = format!("http://127.0.0.1:{peer}");
        let child = Command::new("etcd")
            .args(["--name", "xtask", "--data-dir"])
            .arg(&dir)
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("xtask={peer}")])
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .map_err(|e| format!("starting etcd (Debian's etcd-server; ./x setup installs it): {e}"))?;
        let mut etcd = Etcd { child, dir, log, port };
        // etcd 3.4 logs this once its client listener accepts.
        let serving = format!("serving insecure client requests on 127.0.0.1:{port}");
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            let text = std::fs::read_to_string(&etcd.log).unwrap_or_default();
            if let Ok(Some(_)) = etcd.child.try_wait() {
                let tail: Vec<&str> = text.lines().rev().take(5).collect();
                return Ok(Err(tail.into_iter().rev().collect::<Vec<_>>().join("\n")));
            }
            if text.contains(&serving) {
                return Ok(Ok(etcd));
            }
            if Instant::now() >= until {
                return Err(format!("etcd did not serve on {} within 30 s; its log:\n{text}", etcd.endpoint()));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
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
        let _ = std::fs::remove_file(&self.log);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_etcd_serves_on_its_own_port_and_leaves_nothing_behind() {
        let etcd = Etcd::start().expect("etcd starts (Debian's etcd-server; ./x setup installs it)");
        let log = std::fs::read_to_string(&etcd.log).unwrap();
        assert!(log.contains(&format!("serving insecure client requests on 127.0.0.1:{}", etcd.port)), "{log}");
        assert!(std::net::TcpStream::connect(("127.0.0.1", etcd.port)).is_ok());
        let (dir, log) = (etcd.dir.clone(), etcd.log.clone());
        drop(etcd);
        assert!(!dir.exists() && !log.exists(), "{} and {} removed", dir.display(), log.display());
    }
}
