//! Port attributes and GIDs, and the GID choice (a pure function).

use std::fmt;
use std::net::Ipv6Addr;

/// A path MTU, as `enum ibv_mtu` numbers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Mtu {
    /// 256 bytes.
    Mtu256 = 1,
    /// 512 bytes.
    Mtu512 = 2,
    /// 1024 bytes.
    Mtu1024 = 3,
    /// 2048 bytes.
    Mtu2048 = 4,
    /// 4096 bytes.
    Mtu4096 = 5,
}

impl Mtu {
    /// From the `ibv_mtu` number.
    pub fn from_raw(raw: u32) -> Option<Self> {
        Some(match raw {
            1 => Mtu::Mtu256,
            2 => Mtu::Mtu512,
            3 => Mtu::Mtu1024,
            4 => Mtu::Mtu2048,
            5 => Mtu::Mtu4096,
            _ => return None,
        })
    }

    /// From a size in bytes (256, 512, 1024, 2048 or 4096).
    pub fn from_bytes(bytes: u32) -> Option<Self> {
        Some(match bytes {
            256 => Mtu::Mtu256,
            512 => Mtu::Mtu512,
            1024 => Mtu::Mtu1024,
            2048 => Mtu::Mtu2048,
            4096 => Mtu::Mtu4096,
            _ => return None,
        })
    }

    /// The `ibv_mtu` number.
    pub fn to_raw(self) -> u32 {
        self as u32
    }

    /// The size in bytes.
    pub fn bytes(self) -> u32 {
        128 << (self as u32)
    }
}

impl fmt::Display for Mtu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.bytes())
    }
}

/// A port's logical state (`enum ibv_port_state`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PortState {
    /// `IBV_PORT_NOP`
    Nop,
    /// `IBV_PORT_DOWN`: no link.
    Down,
    /// `IBV_PORT_INIT`: link up, not configured by the subnet manager.
    Init,
    /// `IBV_PORT_ARMED`
    Armed,
    /// `IBV_PORT_ACTIVE`: usable.
    Active,
    /// `IBV_PORT_ACTIVE_DEFER`
    ActiveDefer,
    /// Another value.
    Other(u32),
}

impl PortState {
    /// From the `ibv_port_state` number.
    pub fn from_raw(raw: u32) -> Self {
        match raw {
            0 => PortState::Nop,
            1 => PortState::Down,
            2 => PortState::Init,
            3 => PortState::Armed,
            4 => PortState::Active,
            5 => PortState::ActiveDefer,
            n => PortState::Other(n),
        }
    }
}

impl fmt::Display for PortState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PortState::Nop => f.write_str("PORT_NOP"),
            PortState::Down => f.write_str("PORT_DOWN"),
            PortState::Init => f.write_str("PORT_INIT"),
            PortState::Armed => f.write_str("PORT_ARMED"),
            PortState::Active => f.write_str("PORT_ACTIVE"),
            PortState::ActiveDefer => f.write_str("PORT_ACTIVE_DEFER"),
            PortState::Other(n) => write!(f, "PORT_STATE_{n}"),
        }
    }
}

/// The link layer under a port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkLayer {
    /// InfiniBand: addressed by LID.
    InfiniBand,
    /// Ethernet (RoCE): addressed by GID.
    Ethernet,
    /// Not reported.
    Unspecified,
}

impl LinkLayer {
    /// From `IBV_LINK_LAYER_*`.
    pub fn from_raw(raw: u8) -> Self {
        match raw {
            1 => LinkLayer::InfiniBand,
            2 => LinkLayer::Ethernet,
            _ => LinkLayer::Unspecified,
        }
    }

    /// The `IBV_LINK_LAYER_*` number.
    pub fn to_raw(self) -> u8 {
        match self {
            LinkLayer::Unspecified => 0,
            LinkLayer::InfiniBand => 1,
            LinkLayer::Ethernet => 2,
        }
    }
}

impl fmt::Display for LinkLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LinkLayer::InfiniBand => "InfiniBand",
            LinkLayer::Ethernet => "Ethernet",
            LinkLayer::Unspecified => "Unspecified",
        })
    }
}

/// What `ibv_query_port` reports, in Rust types.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortAttr {
    /// The port number (from 1).
    pub port: u8,
    /// Logical state.
    pub state: PortState,
    /// Largest MTU the port supports.
    pub max_mtu: Mtu,
    /// MTU in use.
    pub active_mtu: Mtu,
    /// Entries in the GID table.
    pub gid_tbl_len: u32,
    /// Local identifier (InfiniBand only; 0 on RoCE).
    pub lid: u16,
    /// Largest message.
    pub max_msg_sz: u32,
    /// Link layer.
    pub link_layer: LinkLayer,
    /// `active_width` code (1 = 1x, 2 = 4x, 4 = 8x, 8 = 12x, 16 = 2x).
    pub active_width: u8,
    /// `active_speed` code (1 = SDR ... 128 = NDR).
    pub active_speed: u8,
}

impl PortAttr {
    /// Lanes in use.
    pub fn lanes(&self) -> u32 {
        match self.active_width {
            1 => 1,
            2 => 4,
            4 => 8,
            8 => 12,
            16 => 2,
            _ => 0,
        }
    }

    /// Signalling rate per lane in Gb/s, and its name.
    pub fn lane_speed(&self) -> (f64, &'static str) {
        match self.active_speed {
            1 => (2.5, "SDR"),
            2 => (5.0, "DDR"),
            4 => (10.0, "QDR"),
            8 => (10.0, "FDR10"),
            16 => (14.0625, "FDR"),
            32 => (25.78125, "EDR"),
            64 => (53.125, "HDR"),
            128 => (106.25, "NDR"),
            _ => (0.0, "unknown"),
        }
    }

    /// The link rate as `ibv_devinfo` and sysfs print it, for example `100 Gb/sec (4X EDR)`.
    pub fn rate(&self) -> String {
        let (per_lane, name) = self.lane_speed();
        let lanes = self.lanes();
        format!("{} Gb/sec ({lanes}X {name})", per_lane * f64::from(lanes))
    }

    /// Whether the port can carry traffic.
    pub fn is_active(&self) -> bool {
        matches!(self.state, PortState::Active | PortState::ActiveDefer)
    }
}

/// A 128-bit global identifier: an IPv6 address on RoCE, subnet prefix plus
/// GUID on InfiniBand.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// The raw bytes, network order.
    pub fn raw(&self) -> [u8; 16] {
        self.0
    }

    /// All zero: an empty GID table entry.
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }

    /// An IPv4-mapped address (`::ffff:a.b.c.d`), what RoCE v2 uses for IPv4.
    pub fn is_ipv4_mapped(&self) -> bool {
        self.0[..10] == [0; 10] && self.0[10..12] == [0xff, 0xff]
    }

    /// An IPv6 link-local address (`fe80::/10`).
    pub fn is_link_local(&self) -> bool {
        self.0[0] == 0xfe && (self.0[1] & 0xc0) == 0x80
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The ibv_devinfo layout: eight groups of four hex digits.
        for (i, pair) in self.0.chunks(2).enumerate() {
            if i > 0 {
                f.write_str(":")?;
            }
            write!(f, "{:02x}{:02x}", pair[0], pair[1])?;
        }
        Ok(())
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({})", Ipv6Addr::from(self.0))
    }
}

/// The kind of a GID table entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GidType {
    /// InfiniBand, or RoCE v1 (sysfs reports both as `IB/RoCE v1`).
    IbOrRoceV1,
    /// RoCE v2 (routable, UDP-encapsulated).
    RoceV2,
    /// Not known (no sysfs attribute).
    Unknown,
}

impl GidType {
    /// From the text of `/sys/class/infiniband/<dev>/ports/<p>/gid_attrs/types/<i>`.
    pub fn from_sysfs(text: &str) -> Self {
        match text.trim() {
            "RoCE v2" => GidType::RoceV2,
            "IB/RoCE v1" | "RoCE v1" | "IB" => GidType::IbOrRoceV1,
            _ => GidType::Unknown,
        }
    }
}

impl fmt::Display for GidType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GidType::IbOrRoceV1 => "IB/RoCE v1",
            GidType::RoceV2 => "RoCE v2",
            GidType::Unknown => "unknown",
        })
    }
}

/// One non-empty entry of a port's GID table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GidEntry {
    /// Its index, what `sgid_index` takes.
    pub index: u32,
    /// The GID.
    pub gid: Gid,
    /// Its type.
    pub gid_type: GidType,
    /// The network device it belongs to (RoCE), when sysfs says.
    pub netdev: Option<String>,
}

/// How a GID index was chosen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GidChoice {
    /// The entry chosen.
    pub entry: GidEntry,
    /// Why, in plain words.
    pub reason: String,
}

/// Picks the GID to address a port by.
///
/// An explicit `override_index` wins when that entry exists (else `None` is
/// returned and the caller reports it). Otherwise, on InfiniBand the first
/// entry; on RoCE, in order of preference: RoCE v2 with an IPv4-mapped
/// address, RoCE v2 with a global IPv6 address, RoCE v2 link-local, then
/// RoCE v1 (what NCCL and perftest users expect). Empty (zero) entries are
/// never chosen; they are not in `entries` in the first place.
pub fn choose_gid(entries: &[GidEntry], link_layer: LinkLayer, override_index: Option<u32>) -> Option<GidChoice> {
    let usable = |e: &&GidEntry| !e.gid.is_zero();
    if let Some(index) = override_index {
        return entries
            .iter()
            .filter(usable)
            .find(|e| e.index == index)
            .map(|e| GidChoice { entry: e.clone(), reason: format!("GID index {index} asked for explicitly") });
    }
    if link_layer == LinkLayer::InfiniBand {
        return entries
            .iter()
            .find(usable)
            .map(|e| GidChoice { entry: e.clone(), reason: "InfiniBand port: the first GID (port GUID)".to_owned() });
    }
    let rank = |e: &GidEntry| -> u8 {
        match (e.gid_type, e.gid.is_ipv4_mapped(), e.gid.is_link_local()) {
            (GidType::RoceV2, true, _) => 0,
            (GidType::RoceV2, false, false) => 1,
            (GidType::RoceV2, false, true) => 2,
            (GidType::Unknown, _, _) => 3,
            (GidType::IbOrRoceV1, _, _) => 4,
        }
    };
    entries.iter().filter(usable).min_by_key(|e| (rank(e), e.index)).map(|e| {
        let reason = match rank(e) {
            0 => "RoCE v2 with an IPv4 address",
            1 => "RoCE v2 with a global IPv6 address",
            2 => "RoCE v2 link-local (no IPv4 or global IPv6 GID on this port)",
            3 => "GID of unknown type (no RoCE v2 entry found)",
            _ => "RoCE v1 (no RoCE v2 entry found)",
        };
        GidChoice { entry: e.clone(), reason: reason.to_owned() }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gid(s: &str) -> Gid {
        Gid(s.parse::<Ipv6Addr>().unwrap().octets())
    }

    fn entry(index: u32, g: &str, t: GidType) -> GidEntry {
        GidEntry { index, gid: gid(g), gid_type: t, netdev: Some("eth0".into()) }
    }

    #[test]
    fn mtu_numbers_and_bytes() {
        assert_eq!(Mtu::Mtu1024.bytes(), 1024);
        assert_eq!(Mtu::Mtu4096.bytes(), 4096);
        assert_eq!(Mtu::from_raw(3), Some(Mtu::Mtu1024));
        assert_eq!(Mtu::from_bytes(2048), Some(Mtu::Mtu2048));
        assert_eq!(Mtu::from_raw(0), None);
        assert_eq!(Mtu::Mtu1024.min(Mtu::Mtu4096), Mtu::Mtu1024);
    }

    #[test]
    fn gid_prints_like_ibv_devinfo() {
        let g = gid("fe80::a835:59ff:fe3d:3e51");
        assert_eq!(g.to_string(), "fe80:0000:0000:0000:a835:59ff:fe3d:3e51");
        assert!(g.is_link_local());
        assert!(!g.is_ipv4_mapped());
        assert!(gid("::ffff:10.1.2.3").is_ipv4_mapped());
    }

    #[test]
    fn roce_prefers_v2_ipv4_then_global_then_link_local() {
        let table = vec![
            entry(0, "fe80::1", GidType::IbOrRoceV1),
            entry(1, "fe80::1", GidType::RoceV2),
            entry(2, "::ffff:192.0.2.7", GidType::IbOrRoceV1),
            entry(3, "::ffff:192.0.2.7", GidType::RoceV2),
            entry(4, "2001:db8::5", GidType::RoceV2),
        ];
        let c = choose_gid(&table, LinkLayer::Ethernet, None).unwrap();
        assert_eq!(c.entry.index, 3, "{c:?}");
        let c = choose_gid(&table[..2], LinkLayer::Ethernet, None).unwrap();
        assert_eq!(c.entry.index, 1);
        assert!(c.reason.contains("link-local"));
        let c = choose_gid(&[table[0].clone(), table[4].clone()], LinkLayer::Ethernet, None).unwrap();
        assert_eq!(c.entry.index, 4);
        let c = choose_gid(&table[..1], LinkLayer::Ethernet, None).unwrap();
        assert_eq!(c.entry.index, 0);
        assert!(c.reason.contains("RoCE v1"));
    }

    #[test]
    fn soft_roce_dummy_netdev_table() {
        // What rxe0 on a dummy netdev shows: only index 0, link-local, RoCE v2.
        let table = vec![entry(0, "fe80::a835:59ff:fe3d:3e51", GidType::RoceV2)];
        assert_eq!(choose_gid(&table, LinkLayer::Ethernet, None).unwrap().entry.index, 0);
        assert_eq!(choose_gid(&table, LinkLayer::Ethernet, Some(1)), None);
    }

    #[test]
    fn override_wins_but_never_picks_an_empty_entry() {
        let table = vec![
            entry(0, "fe80::1", GidType::IbOrRoceV1),
            entry(1, "fe80::1", GidType::RoceV2),
            GidEntry { index: 2, gid: Gid::default(), gid_type: GidType::Unknown, netdev: None },
        ];
        assert_eq!(choose_gid(&table, LinkLayer::Ethernet, Some(0)).unwrap().entry.index, 0);
        assert_eq!(choose_gid(&table, LinkLayer::Ethernet, Some(2)), None);
        assert_eq!(choose_gid(&[], LinkLayer::Ethernet, None), None);
    }

    #[test]
    fn infiniband_takes_the_first_gid() {
        let table = vec![entry(0, "fe80::2:c903:a:b", GidType::IbOrRoceV1)];
        let c = choose_gid(&table, LinkLayer::InfiniBand, None).unwrap();
        assert_eq!(c.entry.index, 0);
    }

    #[test]
    fn rate_matches_sysfs_text() {
        let p = PortAttr {
            port: 1,
            state: PortState::Active,
            max_mtu: Mtu::Mtu4096,
            active_mtu: Mtu::Mtu1024,
            gid_tbl_len: 1,
            lid: 0,
            max_msg_sz: 1 << 31,
            link_layer: LinkLayer::Ethernet,
            active_width: 1,
            active_speed: 1,
        };
        assert_eq!(p.rate(), "2.5 Gb/sec (1X SDR)");
        let p = PortAttr { active_width: 2, active_speed: 32, ..p };
        assert_eq!(p.rate(), "103.125 Gb/sec (4X EDR)");
    }
}
