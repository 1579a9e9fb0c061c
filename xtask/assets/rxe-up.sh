# Sourced at the start of every guest script: brings up the soft-RoCE
# devices rxe0 and rxe1 on two dummy network devices (dummy0, dummy1): one
# NIC for most tests, two for the rail tests. The guest has no network
# device to the outside. No IPv4 address is ever assigned: each rxe device
# is addressed through its IPv6 link-local GID (index 0), and out-of-band
# TCP uses 127.0.0.1.
vm_rxe_up() {
  local rxe=$1 netdev=$2 i
  ip link add "$netdev" type dummy || return 1
  ip link set "$netdev" up || return 1
  for i in $(seq 100); do
    ip -6 addr show dev "$netdev" | grep -q 'fe80::' && break
    sleep 0.05
  done
  rdma link add "$rxe" type rxe netdev "$netdev" || return 1
  for i in $(seq 100); do
    [ "$(cat /sys/class/infiniband/$rxe/ports/1/state 2>/dev/null)" = "4: ACTIVE" ] && return 0
    sleep 0.05
  done
  echo "vm: $rxe did not become active" >&2
  return 1
}
modprobe rdma_rxe || { echo "vm: no rdma_rxe module"; exit 97; }
vm_rxe_up rxe0 dummy0 || { echo "vm: could not bring up rxe0"; exit 97; }
vm_rxe_up rxe1 dummy1 || { echo "vm: could not bring up rxe1"; exit 97; }
echo "vm: rxe0 up on dummy0, GID 0 $(cat /sys/class/infiniband/rxe0/ports/1/gids/0); rxe1 on dummy1"
