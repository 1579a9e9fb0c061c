//! Degraded network: the TCP transport between two network namespaces
//! joined by a veth pair, with `tc netem` delay, jitter, reordering, loss,
//! duplication and corruption on both directions. Every transfer completes
//! and verifies byte for byte, or fails with a typed error; nothing is
//! silently corrupted.
//!
//! The test makes the namespaces itself and addresses the peer by its IPv6
//! link-local address only (no IPv4 address is assigned anywhere). It needs
//! root, `ip`, `tc`, and the veth and sch_netem modules: `#[ignore]`d here,
//! run as root in the soft-RoCE guest by `cargo xtask test`.

mod common;

use std::net::{Ipv6Addr, SocketAddr, SocketAddrV6};
use std::os::fd::AsRawFd;
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use gpu_rdma::{Access, ConnectOptions, Domain, DomainConfig, TransportPolicy};

use common::{first_difference, pattern};

fn run(args: &[&str]) {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap_or_else(|e| panic!("{}: {e}", args[0]));
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

fn output(args: &[&str]) -> String {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap_or_else(|e| panic!("{}: {e}", args[0]));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Two namespaces joined by a veth pair; removed when dropped.
struct Link {
    ns: [String; 2],
}

const DEV: [&str; 2] = ["gra0", "grb0"];

impl Link {
    fn new() -> Link {
        let id = std::process::id();
        let ns = [format!("gpu-rdma-a-{id}"), format!("gpu-rdma-b-{id}")];
        let _ = Command::new("modprobe").args(["-q", "veth"]).status();
        let _ = Command::new("modprobe").args(["-q", "sch_netem"]).status();
        for n in &ns {
            run(&["ip", "netns", "add", n]);
        }
        let link = Link { ns };
        run(&[
            "ip",
            "link",
            "add",
            DEV[0],
            "netns",
            &link.ns[0],
            "type",
            "veth",
            "peer",
            "name",
            DEV[1],
            "netns",
            &link.ns[1],
        ]);
        for (ns, dev) in link.ns.iter().zip(DEV) {
            // No IPv4 anywhere; IPv6 link-local comes up by itself (no
            // duplicate address detection wait).
            run(&["ip", "netns", "exec", ns, "sysctl", "-qw", &format!("net.ipv6.conf.{dev}.accept_dad=0")]);
            run(&["ip", "-n", ns, "link", "set", dev, "up"]);
        }
        link
    }

    /// The link-local address of side `i` and its interface index.
    fn address(&self, i: usize) -> (Ipv6Addr, u32) {
        let t0 = Instant::now();
        loop {
            let text = output(&["ip", "-n", &self.ns[i], "-6", "-o", "addr", "show", "dev", DEV[i]]);
            let addr = text.split_whitespace().skip_while(|w| *w != "inet6").nth(1).and_then(|a| a.split('/').next());
            if let Some(a) = addr.and_then(|a| a.parse().ok()) {
                let index =
                    output(&["ip", "netns", "exec", &self.ns[i], "cat", &format!("/sys/class/net/{}/ifindex", DEV[i])]);
                return (a, index.trim().parse().expect("an interface index"));
            }
            assert!(t0.elapsed() < Duration::from_secs(10), "no link-local address on {}", DEV[i]);
            thread::sleep(Duration::from_millis(100));
        }
    }

    /// Replaces the impairment on both directions.
    fn impair(&self, netem: &str) {
        for (ns, dev) in self.ns.iter().zip(DEV) {
            let mut args = vec!["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "netem"];
            args.extend(netem.split_whitespace());
            run(&args);
        }
    }

    /// Runs `f` on this thread inside namespace `i` (network namespaces are
    /// per thread: sockets made here belong to it, and keep working from any
    /// thread afterwards).
    fn enter(&self, i: usize) {
        let f = std::fs::File::open(format!("/var/run/netns/{}", self.ns[i])).expect("the namespace's file");
        // SAFETY: setns with a valid namespace descriptor affects only the
        // calling thread's network namespace; the descriptor outlives the call.
        let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        for n in &self.ns {
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
    }
}

/// What one impaired run gave.
#[derive(Debug, Default)]
struct Tally {
    verified: usize,
    typed_errors: usize,
}

fn transfers(link: &Link, d: &Domain, netem: &str, tally: &mut Tally) {
    link.impair(netem);
    let (server_ip, _) = link.address(0);
    let len = 4 << 20;
    let target = d.expose(d.alloc(len).unwrap(), Access::REMOTE_WRITE | Access::REMOTE_READ, 1).unwrap();
    let opts =
        ConnectOptions::default().op_timeout(Duration::from_secs(120)).handshake_timeout(Duration::from_secs(60));
    let (s, c) = thread::scope(|sc| {
        let (tx, rx) = std::sync::mpsc::channel();
        let server_opts = opts.clone().advertise(&target);
        let server = sc.spawn(move || {
            link.enter(0);
            let l = d.listen("[::]:0").expect("listen in namespace a");
            tx.send(l.local_addr().unwrap().port()).unwrap();
            l.accept_timeout(&server_opts, Duration::from_secs(60))
        });
        let port = rx.recv().unwrap();
        let opts = &opts;
        let client = sc.spawn(move || {
            link.enter(1);
            // The peer's link-local address, scoped to this side's interface.
            let (_, my_scope) = link.address(1);
            d.connect(SocketAddr::V6(SocketAddrV6::new(server_ip, port, 0, my_scope)), opts)
        });
        (server.join().unwrap(), client.join().unwrap())
    });
    let (s, c) = match (s, c) {
        (Ok(s), Ok(c)) => (s, c),
        (s, c) => {
            // A handshake that fails under impairment must say why, typed.
            let e = s.err().or(c.err()).unwrap();
            println!("netem {netem}: handshake failed, typed: {e}");
            tally.typed_errors += 1;
            return;
        }
    };
    assert_eq!(c.info().transport, "tcp");
    let remote = c.remote_region(1).unwrap();
    let data = pattern(len, netem.len() as u64);
    let t0 = Instant::now();

    // Write, then check the target.
    let mut src = d.alloc(len).unwrap();
    src.copy_from_slice(&data);
    match c.write(src, &remote.whole()).wait() {
        Ok(_) => {
            let mut now = vec![0u8; len];
            target.read_at(0, &mut now).unwrap();
            assert_eq!(first_difference(&now, &data), None, "netem {netem}: a completed write is corrupt");
            tally.verified += 1;
        }
        Err(e) => {
            assert!(!e.is_timeout(), "netem {netem}: write: {e}");
            tally.typed_errors += 1;
        }
    }
    // Read it back.
    match c.read(d.alloc(len).unwrap(), &remote.whole()).finish() {
        Ok((_, back)) => {
            assert_eq!(first_difference(&back, &data), None, "netem {netem}: a completed read is corrupt");
            tally.verified += 1;
        }
        Err(e) => {
            assert!(!e.is_timeout(), "netem {netem}: read: {e}");
            tally.typed_errors += 1;
        }
    }
    // Messages: four of 1 MiB, in order.
    let mut rx: Vec<_> = (0..4).map(|_| s.recv(d.alloc(1 << 20).unwrap())).collect();
    for (i, chunk) in data.chunks(1 << 20).enumerate() {
        let mut m = d.alloc(1 << 20).unwrap();
        m.copy_from_slice(chunk);
        if let Err(e) = c.send(m).wait() {
            assert!(!e.is_timeout(), "netem {netem}: send {i}: {e}");
            tally.typed_errors += 1;
        }
    }
    for (i, r) in rx.drain(..).enumerate() {
        match r.finish() {
            Ok((done, got)) => {
                assert_eq!(done.byte_len as usize, 1 << 20);
                assert!(got[..] == data[i << 20..(i + 1) << 20], "netem {netem}: message {i} is corrupt");
                tally.verified += 1;
            }
            Err(e) => {
                assert!(!e.is_timeout(), "netem {netem}: receive {i}: {e}");
                tally.typed_errors += 1;
            }
        }
    }
    println!("netem {netem}: {:.1} s; so far {tally:?}", t0.elapsed().as_secs_f64());
}

#[test]
#[ignore = "netem: needs root, ip, tc, veth and sch_netem (cargo xtask test runs it in the soft-RoCE guest)"]
fn transfers_over_an_impaired_link_verify_or_fail_typed() {
    let link = Link::new();
    let d = Domain::with_config(&DomainConfig::default().transport(TransportPolicy::Tcp)).unwrap();
    let mut tally = Tally::default();
    for netem in [
        "delay 5ms 3ms",
        "delay 2ms reorder 25% 50%",
        "loss 3%",
        "delay 1ms loss 6% duplicate 5%",
        "corrupt 2% delay 1ms",
    ] {
        transfers(&link, &d, netem, &mut tally);
    }
    println!("netem: 5 impairments, {tally:?}");
    // TCP recovers from all of these: everything arrives, and verifies.
    assert_eq!(tally.typed_errors, 0, "{tally:?}");
    assert_eq!(tally.verified, 5 * 6);
}
