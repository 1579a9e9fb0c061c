//! `cargo xtask instructions`: the CPU cost of one `send-lat` client
//! iteration, perftest's `ib_send_lat` beside `gpu-rdma bench send-lat`, on
//! rxe0 in the guest, counted by callgrind: each client runs 1,000 and then
//! 3,000 iterations (2-byte messages) under callgrind, and the difference
//! of the two totals over 2,000 is the cost of an iteration, with start-up
//! and teardown cancelled out. The servers run natively. Instruction
//! counts are steady where times in an emulated machine are not.

use std::fmt::Write as _;
use std::fs;
use std::time::Duration;

use crate::vm::{self, VmOptions};
use crate::{Result, cargo, root, run as run_cmd, setup};

const SCRIPT: &str = r#"
B=target/release/gpu-rdma
for tool in perftest gpu-rdma; do
  for n in 1000 3000; do
    if [ $tool = perftest ]; then
      srv="ib_send_lat -d rxe0 -x 0 -F -s 2 -n $n"; cli="$srv 127.0.0.1"
    else
      srv="$B bench send-lat --bind 127.0.0.1 -p 18600 -n $n -s 2 -d rxe0"
      cli="$B bench send-lat 127.0.0.1 -p 18600 -n $n -s 2 -d rxe0"
    fi
    timeout 300 $srv > "$VM_OUT/$tool-$n.server" 2>&1 &
    sp=$!
    sleep 1
    timeout 600 valgrind --tool=callgrind --callgrind-out-file="$VM_OUT/$tool-$n.cg" $cli > "$VM_OUT/$tool-$n.client" 2>&1
    wait $sp
  done
done
callgrind_annotate "$VM_OUT/gpu-rdma-3000.cg" 2>/dev/null | sed -n '/file:function/,$p' | grep 'gpu-rdma\]' | head -25 > "$VM_OUT/profile.txt"
exit 0
"#;

/// The total instruction count in a callgrind output file.
pub fn total(cg: &str) -> Option<u64> {
    cg.lines()
        .find_map(|l| l.strip_prefix("summary:").or_else(|| l.strip_prefix("totals:")))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

pub fn command(args: &[String]) -> Result<i32> {
    if !args.is_empty() {
        return Err(format!("instructions takes no arguments; got {args:?}"));
    }
    let kernel = setup::setup()?;
    run_cmd(cargo().args(["build", "--release", "--features", "cli", "--bin", "gpu-rdma"]))?;
    println!(
        "xtask: instructions: ib_send_lat and gpu-rdma bench send-lat under callgrind on rxe0, 1,000 and 3,000 iterations"
    );
    let opts = VmOptions { timeout: Duration::from_secs(1800), ..VmOptions::default() };
    let guest = vm::run_script(&kernel, &root(), SCRIPT, &opts)?;
    let mut out = String::new();
    let mut per = Vec::new();
    for tool in ["perftest", "gpu-rdma"] {
        let count = |n: u32| fs::read_to_string(guest.dir.join(format!("{tool}-{n}.cg"))).ok().and_then(|t| total(&t));
        match (count(1000), count(3000)) {
            (Some(a), Some(b)) if b > a => {
                let each = (b - a) / 2000;
                per.push(each);
                let _ = writeln!(out, "{tool:<9} {a:>12} (1,000) {b:>12} (3,000): {each} instructions per iteration");
            }
            _ => {
                let _ = writeln!(out, "{tool:<9} no count (see {})", guest.dir.display());
            }
        }
    }
    if let [p, g] = per[..] {
        let _ = writeln!(out, "gpu-rdma / perftest: {:.2}x", g as f64 / p as f64);
    }
    print!("{out}");
    if let Ok(profile) = fs::read_to_string(guest.dir.join("profile.txt")) {
        println!("gpu-rdma's own functions, 3,000 iterations (self cost):\n{profile}");
    }
    Ok(if per.len() == 2 { 0 } else { 1 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_callgrind_totals() {
        assert_eq!(total("events: Ir\nsummary: 6815764\n"), Some(6_815_764));
        assert_eq!(total("totals: 12\n"), Some(12));
        assert_eq!(total("events: Ir\n"), None);
    }
}
