#!/bin/busybox sh
# gpu-rdma test VM, stage 1: PID 1 inside the initramfs.
#
# Mounts the host's root file system (shared read-only over virtio-9p) under a
# tmpfs overlay, so the guest sees the host's binaries, libraries and build
# outputs at the same paths and can write anywhere without touching the host.
# Then switch_root into it, so that the kernel's module auto-loading finds
# /sbin/modprobe, and run stage 2 (the command) as PID 1 there.
#
# Kernel command line parameters (set by `cargo xtask vm`):
#   vm.out=DIR     the run directory (shared read-write, tag "vmout")
#   vm.mods=DIR    the extracted kernel's /lib/modules directory on the host
/bin/busybox mkdir -p /bin /proc /sys /dev /lower /rw /newroot
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev

fail() { echo "vm-init: $*"; echo o > /proc/sysrq-trigger; sleep 30; }
param() { sed -n "s/.* vm\.$1=\([^ ]*\).*/\1/p" /proc/cmdline; }

for m in $(cat /modules.order); do
  insmod "/modules/$m.ko" || echo "vm-init: insmod $m failed"
done

OUT=$(param out)
MODS=$(param mods)
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose hostroot /lower || fail "cannot mount the host root"
mount -t tmpfs -o size=3g tmpfs /rw
mkdir -p /rw/upper /rw/work
mount -t overlay overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work /newroot || fail "cannot mount the overlay"

R=/newroot
mount -t proc proc $R/proc
mount -t sysfs sys $R/sys
mount -t devtmpfs dev $R/dev
mkdir -p $R/dev/pts $R/dev/shm $R/run
mount -t devpts devpts $R/dev/pts
mount -t tmpfs tmpfs $R/dev/shm
mount -t tmpfs tmpfs $R/run
# /tmp stays the overlay's: the checkout (and its build outputs) may live there.
KREL=$(uname -r)
mkdir -p $R/lib/modules/$KREL
mount --bind $R$MODS/$KREL $R/lib/modules/$KREL || fail "cannot bind the kernel modules"
mkdir -p $R$OUT
mount -t 9p -o trans=virtio,version=9p2000.L,rw,msize=512000 vmout $R$OUT || fail "cannot mount the run directory"

cat > $R/run/vm-stage2 <<EOS
#!/bin/bash
# Stage 2: PID 1 in the shared root. Runs the command, records its exit code, powers off.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root TERM=dumb VM_OUT=$OUT
ip link set lo up 2>/dev/null
hostname gpu-rdma-vm 2>/dev/null
cut -d' ' -f1 /proc/uptime > $OUT/boot_seconds
(cd $OUT && setsid /bin/bash $OUT/guest.sh </dev/null >/dev/console 2>&1)
echo \$? > $OUT/exit_code
sync
umount $OUT 2>/dev/null
/run/busybox poweroff -f
EOS
chmod +x $R/run/vm-stage2
cp /bin/busybox $R/run/busybox
exec switch_root $R /run/vm-stage2
