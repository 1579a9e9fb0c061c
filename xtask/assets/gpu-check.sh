#!/bin/bash
# gpu-rdma GPU check: one prepared run on a machine with an NVIDIA GPU.
# Built by `cargo xtask gpu-check` (binaries + the rdma-core libraries they
# link, no Rust toolchain needed here). Prints a short report; writes it to
# $OUT/report.txt when OUT is set.
HERE=$(cd "$(dirname "$0")" && pwd)
# The machine's own rdma-core when it has one (a bundled libibverbs can fail
# to load a MOFED provider); the bundled copy only where there is none.
if ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1 '; then
  VERBS_LIB="the machine's own ($(ldconfig -p | grep 'libibverbs.so.1 ' | head -n 1 | sed 's/.*=> //'))"
else
  export LD_LIBRARY_PATH="$HERE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  VERBS_LIB="bundled ($HERE/lib)"
fi
# Tests that need the CUDA stand-in's hooks (CPU faults on device pointers,
# chosen device attributes, the peermem stand-in's record): not run here.
STUB_ONLY="--skip the_cpu_faults_on_a_device_pointer --skip dma_buf_export_asks_for_the_pcie_mapping_and_falls_back --skip the_flush_follows_the_device_attributes --skip gpu_registrations_ask_for_relaxed_ordering"
OUT=${OUT:-$HERE/out}
mkdir -p "$OUT"
REPORT=$OUT/report.txt
: > "$REPORT"
say() { echo "$*" | tee -a "$REPORT"; }
section() { echo; say "== $*"; }
fails=0
# Every step has a time limit: a hang must fail its step, not eat the run.
T=${GPU_CHECK_STEP_TIMEOUT:-180}

section "machine"
say "host: $(uname -srm)"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi -L 2>&1 | tee -a "$REPORT"
  nvidia-smi --query-gpu=driver_version,name,pci.bus_id,memory.total --format=csv,noheader 2>&1 | tee -a "$REPORT"
  nvidia-smi topo -m > "$OUT/nvidia-smi-topo.txt" 2>&1 && say "nvidia-smi topo -m saved to nvidia-smi-topo.txt"
else
  say "nvidia-smi: not found"
fi
say "kernel modules: $(grep -oE '^(nvidia[a-z_]*|nv_peer_mem|ib_core|mlx5_ib|rdma_rxe)' /proc/modules | tr '\n' ' ')"
say "open kernel module: $(grep -q 'Open Kernel Module' /proc/driver/nvidia/version 2>/dev/null && echo yes || echo no/unknown)"
say "libibverbs: $VERBS_LIB"
say "libcuda: $(ldconfig -p 2>/dev/null | grep -E 'libcuda\.so(\.1)? ' | sed 's/.*=> //' | tr '\n' ' ')"

section "gpu-rdma doctor (a GPU and, unless the machine has one, no RDMA NIC: the verdict must say why)"
timeout $T "$HERE/bin/gpu-rdma" doctor > "$OUT/doctor-first.txt" 2>&1
say "doctor exit $?"
sed -n '1,80p' "$OUT/doctor-first.txt" | tee -a "$REPORT"

section "gpu-rdma gpu --bandwidth (attributes, memory paths, host<->device copy bandwidth)"
timeout $T "$HERE/bin/gpu-rdma" gpu --bandwidth 2>&1 | tee -a "$REPORT" || fails=$((fails + 1))

section "CUDA layer tests: allocation and alignment, SYNC_MEMOPS, dma-buf export, copies, streams"
timeout $T "$HERE/bin/cuda-tests" --ignored --test-threads=1 $STUB_ONLY > "$OUT/cuda-tests.log" 2>&1
rc=$?
grep -E '^test |test result' "$OUT/cuda-tests.log" | tee -a "$REPORT"
[ $rc = 0 ] || { fails=$((fails + 1)); tail -40 "$OUT/cuda-tests.log"; }

section "GPU to GPU between two processes over TCP (staged through host memory)"
# The transport every machine has. 256 MiB from GPU memory in one process into
# GPU memory in the other, checked page by page on the receiving GPU.
GPU_RDMA_TRANSPORT=tcp timeout $T "$HERE/bin/gpu_to_gpu" --listen 127.0.0.1:7480 --bytes 256MiB > "$OUT/tcp-receiver.log" 2>&1 &
rpid=$!
GPU_RDMA_TRANSPORT=tcp timeout $T "$HERE/bin/gpu_to_gpu" --connect 127.0.0.1:7480 --bytes 256MiB --timeout 120 > "$OUT/tcp-sender.log" 2>&1
src=$?
wait $rpid
rrc=$?
sed 's/^/  sender   | /' "$OUT/tcp-sender.log" | tee -a "$REPORT"
sed 's/^/  receiver | /' "$OUT/tcp-receiver.log" | tee -a "$REPORT"
if [ $src = 0 ] && [ $rrc = 0 ] && grep -q 'verified: all 268435456 bytes match' "$OUT/tcp-receiver.log" \
   && grep -q '^sender: over tcp' "$OUT/tcp-sender.log" && grep -q '^receiver: GPU memory path staged' "$OUT/tcp-receiver.log"; then
  say "GPU to GPU over TCP: verified"
else
  say "GPU to GPU over TCP: FAILED (sender exit $src, receiver exit $rrc)"
  fails=$((fails + 1))
fi
timeout $T "$HERE/bin/gpu-tcp-tests" --ignored --test-threads=1 > "$OUT/gpu-tcp.log" 2>&1 || fails=$((fails + 1))
grep -E '^test |test result' "$OUT/gpu-tcp.log" | tee -a "$REPORT"

section "a model's tensors in GPU memory (cudarc blocks, tensors as views), lists and one by one"
# What a framework moves: a few hundred tensors carved from cudarc blocks,
# into the receiver's GPU arena, verified on the GPU after the one note.
for flags in "--gpu" "--gpu --per-tensor"; do
  if timeout $T "$HERE/bin/tensors" $flags > "$OUT/tensors.log" 2>&1 && grep -q 'all 320 tensors verified' "$OUT/tensors.log"; then
    say "tensors $flags: $(grep -E 'verified|registered' "$OUT/tensors.log" | tr '\n' ' ')"
  else
    say "tensors $flags: FAILED ($(tail -n 1 "$OUT/tensors.log"))"
    fails=$((fails + 1))
  fi
done

section "Python: a DLPack CUDA tensor through the binding (the wheel unpacked from the bundle)"
if command -v python3 >/dev/null; then
  if PYTHONPATH="$HERE/python" timeout $T python3 "$HERE/python/gpu_check.py" > "$OUT/python.log" 2>&1; then
    sed 's/^/  /' "$OUT/python.log" | tee -a "$REPORT"
  else
    sed 's/^/  /' "$OUT/python.log" | tee -a "$REPORT"
    say "python gpu-check: FAILED"
    fails=$((fails + 1))
  fi
else
  say "no python3 on this machine: the Python check is not run"
fi

section "a staged 4 KiB round trip, waited for and awaited (one process: one CUDA context on the GPU)"
# What the library adds to a small staged message: two copies each way and
# how soon the waiting (or awaiting) thread notices each.
timeout $T "$HERE/bin/staged_latency" 4096 2000 > "$OUT/staged-latency.log" 2>&1 || fails=$((fails + 1))
sed 's/^/  /' "$OUT/staged-latency.log" | tee -a "$REPORT"

section "gpu-rdma bench: --mem-path sweep over TCP (write-bw and read-bw, 1 MiB; send-lat, 4 KiB)"
# Host memory against GPU memory staged through host memory, in perftest's
# table. Direct paths need an RDMA NIC; forcing one here must be a clear error.
sweep() { # transport, extra flags, test, size, iterations, mem-path[, the server's mem-path]
  local smp=${7:-$6}
  local log="$OUT/bench-$1-$3-$6-$smp.log"
  timeout $T "$HERE/bin/gpu-rdma" bench "$3" --transport "$1" $2 --mem-path "$smp" -s "$4" -n "$5" --bind 127.0.0.1 -p 18530 > "$log.server" 2>&1 &
  local sp=$!
  sleep 1
  timeout $T "$HERE/bin/gpu-rdma" bench "$3" --transport "$1" $2 --mem-path "$6" -s "$4" -n "$5" -p 18530 127.0.0.1 > "$log" 2>&1
  local rc=$?
  wait $sp
  echo "  $3 $6, server $smp (exit $rc): $(grep -E '^ path:' "$log" | head -n 1 | cut -c1-160)"
  grep -A1 '#bytes' "$log" | tail -n 1 | sed 's/^/    /'
  grep -h -E '^ (Staging slots|staging:)' "$log" | sed 's/^/   /'
  return $rc
}
# Both ends on the one GPU: their two CUDA contexts take turns on it, and a
# small copy can wait for the other's turn (about 140 us on an H200). The
# "server host" rows keep one context on the GPU, as a machine per peer has.
for t in "write-bw 1MiB 500" "read-bw 1MiB 500" "send-lat 4096 1000"; do
  set -- $t
  for mp in "host host" "staged staged" "staged host"; do
    row=$(sweep tcp "--gpu 0" "$1" "$2" "$3" $mp 2>&1) || fails=$((fails + 1))
    say "$row"
  done
done
# Depth: the same staged write with 8 requests in flight, against 128 above
# (on 4 December, before staging slots were pinned ahead and kept, 8 ran
# faster than 128).
row=$(sweep tcp "--gpu 0 -t 8" write-bw 1MiB 500 staged host 2>&1) || fails=$((fails + 1))
say "  at -t 8: ${row#  }"
for mp in dmabuf peermem; do
  if sweep tcp "--gpu 0" write-bw 1MiB 100 "$mp" > "$OUT/sweep-$mp.txt" 2>&1; then
    say "  --mem-path $mp over TCP: ran, but there is no NIC to register GPU memory with: FAILED"
    fails=$((fails + 1))
  else
    say "  --mem-path $mp over TCP: refused, as it must be: $(grep -h 'gpu-rdma bench:' "$OUT"/bench-tcp-write-bw-$mp-$mp.log* | head -n 1 | cut -c1-200)"
  fi
done

section "RDMA NIC: GPUDirect RDMA on a real port"
# A machine with an active port other than soft-RoCE (mlx5 and friends):
# both direct paths forced, small and unaligned GPU buffers, VMM memory,
# the flush, a producer loop checked by the receiver, GPU to GPU verified.
nic=""
for d in /sys/class/infiniband/*; do
  [ -e "$d" ] || continue
  n=$(basename "$d")
  case $n in rxe*|siw*) continue ;; esac
  for p in "$d"/ports/*; do
    if grep -q ACTIVE "$p/state" 2>/dev/null; then nic=$n; break 2; fi
  done
done
if [ -n "$nic" ]; then
  say "active port on $nic ($(cat /sys/class/infiniband/$nic/ports/*/link_layer 2>/dev/null | head -n 1))"
  timeout $T "$HERE/bin/gpu-rdma" doctor > "$OUT/doctor.txt" 2>&1
  sed -n '1,60p' "$OUT/doctor.txt" | tee -a "$REPORT"
  for path in dmabuf peermem staged; do
    if GPU_RDMA_DEVICE=$nic timeout $T "$HERE/bin/gpu_to_gpu" --path $path --bytes 256MiB > "$OUT/nic-$path.log" 2>&1; then
      say "GPU to GPU over $nic, $path path: $(grep -E 'verified|GB/s' "$OUT/nic-$path.log" | tail -n 2 | tr '\n' ' ')"
    else
      say "GPU to GPU over $nic, $path path: FAILED ($(tail -n 1 "$OUT/nic-$path.log"))"
      fails=$((fails + 1))
    fi
  done
  # Every verbs GPU test on the NIC: an 8-byte send from GPU memory on a direct
  # path, a tensor at offset 512 on every path, VMM memory, the flush on
  # receives, 1,000 produced iterations on the direct and staged paths.
  GPU_RDMA_TEST_DEVICE=$nic timeout $T "$HERE/bin/verbs-gpu-tests" --ignored --test-threads=1 $STUB_ONLY > "$OUT/nic-verbs-gpu.log" 2>&1 \
    || fails=$((fails + 1))
  grep -E '^test |test result' "$OUT/nic-verbs-gpu.log" | tee -a "$REPORT"
  for mp in dmabuf peermem staged host; do
    row=$(sweep verbs "--gpu 0 -d $nic" write-bw 1MiB 500 "$mp" 2>&1) || fails=$((fails + 1))
    say "$row"
  done
else
  say "no active RDMA port other than soft-RoCE: the real-NIC section is not run"
fi

section "staged pipeline between two GPU buffers over soft-RoCE"
# The machine has no RDMA NIC. Soft-RoCE, where the kernel has it, gives a
# real verbs transport; no IPv4 address is assigned (link-local GID only).
rxe=""
if modprobe rdma_rxe 2>/dev/null && ip link add gpurdma0 type dummy 2>/dev/null && ip link set gpurdma0 up \
   && sleep 1 && rdma link add rxe_gpu type rxe netdev gpurdma0 2>/dev/null; then
  rxe=rxe_gpu
  export RDMAV_DRIVERS=rxe
fi
if [ -n "$rxe" ]; then
  say "soft-RoCE device $rxe up"
  GPU_RDMA_DEVICE=$rxe timeout $T "$HERE/bin/gpu_to_gpu" --path staged --bytes 256MiB 2>&1 | tee -a "$REPORT" || fails=$((fails + 1))
  GPU_RDMA_DEVICE=$rxe timeout $T "$HERE/bin/gpu_to_gpu" --compare --bytes 256MiB 2>&1 | tee -a "$REPORT" || fails=$((fails + 1))
  # The staged tests only: soft-RoCE cannot pin GPU pages for the direct paths.
  GPU_RDMA_TEST_DEVICE=$rxe timeout $T "$HERE/bin/verbs-gpu-tests" --ignored --test-threads=1 staged --skip direct > "$OUT/verbs-gpu.log" 2>&1 \
    || fails=$((fails + 1))
  grep -E '^test |test result' "$OUT/verbs-gpu.log" | tee -a "$REPORT"
else
  say "no RDMA device on this machine (no NIC, and soft-RoCE could not be loaded): the verbs half is not run;"
  say "the TCP section above carried GPU memory instead."
fi

section "summary"
say "gpu-check: $fails step(s) failed"
[ $fails = 0 ]
