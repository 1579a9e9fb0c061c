# Sourced at the start of every guest script: brings up the soft-RoCE device
# rxe0 on a dummy network device. The guest has no network device to the
# outside. No IPv4 address is ever assigned: rxe0 is addressed through its
# IPv6 link-local GID (index 0), and out-of-band TCP uses 127.0.0.1.
vm_rxe_up() {
  modprobe rdma_rxe || return 1
  ip link add dummy0 type dummy || return 1
  ip link set dummy0 up || return 1
  local i
  for i in $(seq 100); do
    ip -6 addr show dev dummy0 | grep -q 'fe80::' && break
    sleep 0.05
  done
  rdma link add rxe0 type rxe netdev dummy0 || return 1
  for i in $(seq 100); do
    [ "$(cat /sys/class/infiniband/rxe0/ports/1/state 2>/dev/null)" = "4: ACTIVE" ] && return 0
    sleep 0.05
  done
  echo "vm: rxe0 did not become active" >&2
  return 1
}
vm_rxe_up || { echo "vm: could not bring up rxe0"; exit 97; }
echo "vm: rxe0 up on dummy0, GID 0 $(cat /sys/class/infiniband/rxe0/ports/1/gids/0)"
