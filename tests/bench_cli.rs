//! `gpu-rdma bench` end to end, as a user runs it: a server process and a
//! client process over TCP on loopback, the client's `--json` report read
//! back. Both the busy-polling default and perftest's `-e` (sleep on
//! completion events) must measure every iteration and report figures
//! that make sense.

#![cfg(feature = "cli")]

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

const TOOL: &str = env!("CARGO_BIN_EXE_gpu-rdma");

/// A process killed when dropped, if still running.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Runs `test` between a server and a client process with `extra` flags on
/// both sides; returns the client's JSON report.
fn run(test: &str, size: &str, iters: u32, extra: &[&str]) -> serde_json::Value {
    let port = free_port().to_string();
    let common = ["--transport", "tcp", "-p", &port, "-s", size, "-n", &iters.to_string(), "--timeout", "30"];
    let mut server = Proc(
        Command::new(TOOL)
            .args(["bench", test, "--bind", "127.0.0.1"])
            .args(common)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the bench server"),
    );
    // The client starts once the server says it waits (it listens by then).
    let out = server.0.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if line.contains("Waiting for client") {
                let _ = tx.send(());
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(30)).expect("the server never said it waits for a client");
    let client = Command::new(TOOL)
        .args(["bench", test, "127.0.0.1", "--json"])
        .args(common)
        .args(extra)
        .stderr(Stdio::inherit())
        .output()
        .expect("run the bench client");
    assert!(client.status.success(), "{test} {extra:?}: the client failed: {:?}", client.status);
    let status = server.0.wait().expect("the server ends");
    assert!(status.success(), "{test} {extra:?}: the server failed: {status:?}");
    serde_json::from_slice(&client.stdout).expect("the client prints one JSON document")
}

fn figure(row: &serde_json::Value, key: &str) -> f64 {
    row[key].as_f64().unwrap_or_else(|| panic!("no number `{key}` in {row}"))
}

/// The one row of a one-size run, after checking the report's frame.
fn only_row(doc: &serde_json::Value, test: &str, iters: u32) -> serde_json::Value {
    assert_eq!(doc["role"], "client", "{doc}");
    assert_eq!(doc["test"], test, "{doc}");
    assert_eq!(doc["transport"], "tcp", "{doc}");
    let rows = doc["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 1, "{doc}");
    let row = rows[0].clone();
    assert_eq!(row["iterations"].as_u64(), Some(u64::from(iters)), "{row}");
    row
}

fn latency(extra: &[&str]) {
    let doc = run("send-lat", "256", 300, extra);
    let row = only_row(&doc, "send-lat", 300);
    let (min, typ, max) = (figure(&row, "t_min"), figure(&row, "t_typical"), figure(&row, "t_max"));
    println!("send-lat 256 B over TCP {extra:?}: t_min {min} us, t_typical {typ} us, t_max {max} us");
    assert!(min > 0.0 && min <= typ && typ <= max, "{row}");
}

fn bandwidth(extra: &[&str]) {
    let doc = run("write-bw", "64KiB", 400, extra);
    let row = only_row(&doc, "write-bw", 400);
    let avg = figure(&row, "bw_average_mib_s");
    println!("write-bw 64 KiB over TCP {extra:?}: {avg} MiB/s average");
    assert!(avg > 0.0 && avg.is_finite(), "{row}");
}

#[test]
fn send_lat_busy_polling() {
    latency(&[]);
}

#[test]
fn send_lat_sleeping_on_events() {
    latency(&["-e"]);
}

#[test]
fn write_bw_busy_polling() {
    bandwidth(&[]);
}

#[test]
fn write_bw_sleeping_on_events() {
    bandwidth(&["-e"]);
}

/// With a CUDA driver (the stand-in in `cargo xtask test`'s tier 1b, or a
/// GPU): both sides in staged GPU memory pin the slots their loops hold
/// before the clock starts, and the report says none was pinned during
/// the test (a reservation short of what the loops hold would show here).
#[test]
#[cfg(feature = "cuda")]
#[ignore = "cuda: needs a CUDA driver (the stand-in via cargo xtask test, or a GPU via cargo xtask gpu-check)"]
fn staged_gpu_memory_pins_its_slots_before_the_clock_starts() {
    let cases: [(&str, &str, u32, &[&str], u64); 2] =
        [("write-bw", "1MiB", 200, &["-t", "32"], 32), ("send-lat", "4096", 200, &[], 4)];
    for (test, size, iters, extra, slots) in cases {
        let mut flags = vec!["--gpu", "0", "--mem-path", "staged"];
        flags.extend_from_slice(extra);
        let doc = run(test, size, iters, &flags);
        only_row(&doc, test, iters);
        assert!(doc["memory"].as_str().is_some_and(|m| m.contains("staged")), "{doc}");
        let staging = &doc["staging"];
        println!("{test} {size}, staged: {staging}");
        assert_eq!(staging["reserved_slots"].as_u64(), Some(slots), "{test}: {doc}");
        assert_eq!(staging["pinned_during_test"].as_u64(), Some(0), "{test}: {doc}");
    }
}
