//! Kernel WireGuard through `wireguard-control` (generic netlink) and `rtnetlink`
//! (link kind `wireguard`), on a thread inside the target namespace.
//!
//! The development host has no WireGuard in its kernel: this backend is tested in the
//! suite's VM tier (Debian's 6.1 kernel, `scripts/vm.sh`). The diff it applies is the
//! same pure [`super::diff`] the userspace backend uses, and like that backend it
//! remembers what it last read or wrote ([`KnownState`]), so a per-peer change that
//! changes nothing writes nothing.

use std::str::FromStr;

use futures::TryStreamExt;
use rtnetlink::LinkWireguard;
use wireguard_control::{Backend, Device, DeviceUpdate, InterfaceName, Key, PeerConfigBuilder};

use super::{
    align_order, apply_peer_updates, apply_update, diff, diff_peers, validate_changes, DevicePeer,
    DeviceState, Indexed, KnownState, PeerChange, PresharedKey, PrivateKey, PublicKey, WgDevice,
    WgError, WgStatus, WgUpdate, WireGuard,
};
use crate::netns::{Netns, NetnsThread};

/// Whether the kernel of `netns` can create a WireGuard link (probe: create and delete
/// a uniquely named one).
#[must_use]
pub fn supported(netns: &Netns) -> bool {
    let Ok(thread) = NetnsThread::spawn(netns) else {
        return false;
    };
    let name = format!("wsprobe{}", std::process::id() % 100_000);
    thread
        .block_on(move || async move {
            let (conn, h, _) = rtnetlink::new_connection().ok()?;
            tokio::spawn(conn);
            h.link()
                .add(LinkWireguard::new(&name).build())
                .execute()
                .await
                .ok()?;
            let mut links = h.link().get().match_name(name).execute();
            if let Ok(Some(l)) = links.try_next().await {
                let _ = h.link().del(l.header.index).execute().await;
            }
            Some(())
        })
        .ok()
        .flatten()
        .is_some()
}

/// Whether this host's kernel can create a WireGuard link, probed in a throwaway
/// network namespace (`unshare --net`, gone with the command): unlike [`supported`]
/// it never touches the caller's namespace. For tools that choose a backend for
/// namespaces they have not made yet (the lab, the benchmarks).
#[must_use]
pub fn supported_on_host() -> bool {
    std::process::Command::new("unshare")
        .args(["--net", "ip", "link", "add", "wsprobe", "type", "wireguard"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Kernel backend for one interface.
#[derive(Debug)]
pub struct KernelBackend {
    name: String,
    iface: InterfaceName,
    thread: NetnsThread,
    writes: u64,
    known: KnownState,
}

fn io<'a>(op: &'static str, name: &'a str) -> impl FnOnce(std::io::Error) -> WgError + 'a {
    move |source| WgError::Io {
        op,
        name: name.to_owned(),
        source,
    }
}

fn to_state(d: &Device) -> DeviceState {
    DeviceState {
        private_key: d.private_key.as_ref().map(|k| PrivateKey::from_bytes(k.0)),
        listen_port: d.listen_port.unwrap_or_default(),
        fwmark: d.fwmark.unwrap_or_default(),
        peers: d
            .peers
            .iter()
            .map(|p| DevicePeer {
                public_key: PublicKey::from_bytes(p.config.public_key.0),
                preshared_key: p
                    .config
                    .preshared_key
                    .as_ref()
                    .filter(|k| k.0 != [0; 32])
                    .map(|k| PresharedKey::from_bytes(k.0)),
                endpoint: p.config.endpoint,
                persistent_keepalive: p.config.persistent_keepalive_interval.unwrap_or_default(),
                allowed_ips: p
                    .config
                    .allowed_ips
                    .iter()
                    .filter_map(|a| ipnet::IpNet::new(a.address, a.cidr).ok())
                    .collect(),
                last_handshake: p.stats.last_handshake_time,
                rx_bytes: p.stats.rx_bytes,
                tx_bytes: p.stats.tx_bytes,
            })
            .collect(),
    }
}

fn to_update(up: &WgUpdate) -> DeviceUpdate {
    let mut u = DeviceUpdate::new();
    if let Some(p) = up.listen_port {
        u = u.set_listen_port(p);
    }
    if let Some(m) = up.fwmark {
        u = u.set_fwmark(m);
    }
    if let Some(k) = &up.private_key {
        u = u.set_private_key(Key(*k.as_bytes()));
    }
    for p in &up.peers {
        let key = Key(*p.public_key.as_bytes());
        if p.remove {
            u = u.remove_peer_by_key(&key);
            continue;
        }
        let mut b = PeerConfigBuilder::new(&key);
        match &p.preshared_key {
            Some(Some(k)) => b = b.set_preshared_key(Key(*k.as_bytes())),
            Some(None) => b = b.unset_preshared_key(),
            None => {}
        }
        if let Some(e) = p.endpoint {
            b = b.set_endpoint(e);
        }
        if let Some(k) = p.persistent_keepalive {
            b = b.set_persistent_keepalive_interval(k);
        }
        if let Some(ips) = &p.allowed_ips {
            b = b.replace_allowed_ips();
            for ip in ips {
                b = b.add_allowed_ip(ip.addr(), ip.prefix_len());
            }
        }
        u = u.add_peer(b);
    }
    u
}

/// An update that sets only the listen port.
fn port_only(port: u16) -> WgUpdate {
    WgUpdate {
        listen_port: Some(port),
        ..WgUpdate::default()
    }
}

impl KernelBackend {
    fn create_link(&self) -> Result<(), WgError> {
        let name = self.name.clone();
        self.thread
            .block_on(move || async move {
                let (conn, h, _) = rtnetlink::new_connection()?;
                tokio::spawn(conn);
                h.link()
                    .add(LinkWireguard::new(&name).build())
                    .execute()
                    .await
                    .map_err(std::io::Error::other)
            })
            .map_err(io("create link", &self.name))?
            .map_err(io("create link", &self.name))
    }

    /// A backend for `name` in `netns`.
    ///
    /// # Errors
    /// Bad name or the namespace cannot be entered.
    pub fn new(name: &str, netns: &Netns) -> Result<Self, WgError> {
        let iface = InterfaceName::from_str(name).map_err(|_| {
            crate::Invalid::new("name", format!("{name:?} is not a valid interface name"))
        })?;
        let thread = NetnsThread::spawn(netns).map_err(io("enter namespace", name))?;
        Ok(Self {
            name: name.to_owned(),
            iface,
            thread,
            writes: 0,
            known: KnownState::default(),
        })
    }

    /// Writes `up`. The kernel sets the fwmark before the port and stops at a refused
    /// port (peers and key after it), so a port change goes first, alone: refused, it
    /// has changed nothing. A refusal is [`WgError::Refused`] with the kernel's errno,
    /// as from wireguard-go. The remembered state is forgotten until the write is done.
    fn write(&mut self, up: &WgUpdate) -> Result<(), WgError> {
        self.known.forget();
        let rest = match up.listen_port {
            Some(port) if up != &port_only(port) => {
                self.send(DeviceUpdate::new().set_listen_port(port))?;
                WgUpdate {
                    listen_port: None,
                    ..up.clone()
                }
            }
            _ => up.clone(),
        };
        self.send(to_update(&rest))?;
        self.writes += 1;
        Ok(())
    }

    fn send(&self, update: DeviceUpdate) -> Result<(), WgError> {
        let iface = self.iface;
        self.thread
            .run(move || update.apply(&iface, Backend::Kernel))
            .map_err(io("set", &self.name))?
            .map_err(|e| match e.raw_os_error() {
                Some(errno) => WgError::Refused {
                    name: self.name.clone(),
                    errno,
                },
                None => io("set", &self.name)(e),
            })
    }

    fn read(&self) -> Result<Option<DeviceState>, WgError> {
        let iface = self.iface;
        let r = self
            .thread
            .run(move || Device::get(&iface, Backend::Kernel))
            .map_err(io("get", &self.name))?;
        match r {
            Ok(d) => Ok(Some(to_state(&d))),
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => Ok(None),
            Err(e) => Err(io("get", &self.name)(e)),
        }
    }
}

impl WireGuard for KernelBackend {
    fn name(&self) -> &str {
        &self.name
    }

    fn ensure(&mut self) -> Result<(), WgError> {
        if self.read()?.is_none() {
            self.create_link()?;
        }
        Ok(())
    }

    fn apply(&mut self, desired: &WgDevice) -> Result<bool, WgError> {
        desired.validate()?;
        // Every whole-device apply reads (the existence check and the diff base): a
        // link deleted behind our back is recreated here.
        let now = std::time::Instant::now();
        let current = match self.read()? {
            Some(st) => st,
            None => {
                self.create_link()?;
                DeviceState::default()
            }
        };
        let up = diff(&current, desired);
        if up.is_empty() {
            self.known.remember_indexed(0, Indexed::new(now, current));
            return Ok(false);
        }
        self.write(&up)?;
        let mut after = current;
        apply_update(&mut after, &up);
        align_order(&mut after, desired);
        self.known.remember_indexed(0, Indexed::new(now, after));
        Ok(true)
    }

    fn apply_peers(&mut self, changes: &[PeerChange]) -> Result<bool, WgError> {
        if changes.is_empty() {
            return Ok(false);
        }
        let now = std::time::Instant::now();
        let mut known = match self.known.take_fresh_indexed(now, 0) {
            Some(k) => k,
            None => {
                let st = match self.read()? {
                    Some(st) => st,
                    None => {
                        self.create_link()?;
                        DeviceState::default()
                    }
                };
                Indexed::new(now, st)
            }
        };
        if let Err(e) = validate_changes(known.own.as_ref(), changes) {
            self.known.remember_indexed(0, known);
            return Err(e.into());
        }
        // Only what differs, each peer in place: the kernel keeps its session,
        // handshake and counters.
        let peers = diff_peers(&known.state, &known.index, changes);
        if peers.is_empty() {
            self.known.remember_indexed(0, known);
            return Ok(false);
        }
        let up = WgUpdate {
            peers,
            ..WgUpdate::default()
        };
        self.write(&up)?;
        apply_peer_updates(&mut known.state, &mut known.index, &up.peers);
        self.known.remember_indexed(0, known);
        Ok(true)
    }

    fn observe(&mut self) -> Result<WgStatus, WgError> {
        let now = std::time::Instant::now();
        let Some(st) = self.read()? else {
            self.known.forget();
            return Ok(WgStatus::default());
        };
        let status = WgStatus::from(&st);
        self.known.remember(now, 0, st);
        Ok(status)
    }

    fn teardown(&mut self) -> Result<(), WgError> {
        self.known.forget();
        let name = self.name.clone();
        self.thread
            .block_on(move || async move {
                let (conn, h, _) = rtnetlink::new_connection()?;
                tokio::spawn(conn);
                let mut links = h.link().get().match_name(name).execute();
                if let Ok(Some(l)) = links.try_next().await {
                    h.link()
                        .del(l.header.index)
                        .execute()
                        .await
                        .map_err(std::io::Error::other)?;
                }
                Ok::<_, std::io::Error>(())
            })
            .map_err(io("delete link", &self.name))?
            .map_err(io("delete link", &self.name))
    }

    fn writes(&self) -> u64 {
        self.writes
    }

    fn backend(&self) -> &'static str {
        "kernel"
    }
}
