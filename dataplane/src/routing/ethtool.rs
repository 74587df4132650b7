//! What ethtool reports of a link: driver (`ETHTOOL_GDRVINFO`), speed and duplex
//! (`ETHTOOL_GSET`), through the `SIOCETHTOOL` ioctl on a socket of the caller's
//! network namespace (so it describes the same links as the netlink dump, unlike
//! sysfs, which describes the namespace that mounted it).

#![allow(unsafe_code)] // Two SIOCETHTOOL ioctls on an owned socket.

use std::{io, os::fd::AsRawFd};

const SIOCETHTOOL: libc::c_ulong = 0x8946;
const ETHTOOL_GSET: u32 = 0x01;
const ETHTOOL_GDRVINFO: u32 = 0x03;
/// `sizeof(struct ethtool_cmd)`.
const CMD_LEN: usize = 44;
/// `sizeof(struct ethtool_drvinfo)`.
const DRVINFO_LEN: usize = 196;

/// Driver, speed and duplex of one link; empty or 0 where the driver reports none.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EthtoolInfo {
    /// Driver name (`veth`, `bridge`, `e1000e`, …).
    pub driver: String,
    /// Link speed in Mb/s; 0 = unknown.
    pub speed_mbps: u32,
    /// `full`, `half`, or empty when unknown.
    pub duplex: String,
}

/// The kernel's `struct ifreq` with `ifr_data` pointing at an ethtool command buffer.
#[repr(C)]
struct IfReqData {
    name: [u8; libc::IFNAMSIZ],
    data: *mut u8,
    _pad: [u8; 16],
}

fn ethtool(sock: &std::net::UdpSocket, name: &str, buf: &mut [u8]) -> io::Result<()> {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes.len() >= libc::IFNAMSIZ || bytes.contains(&0) {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    let mut req = IfReqData {
        name: [0; libc::IFNAMSIZ],
        data: buf.as_mut_ptr(),
        _pad: [0; 16],
    };
    req.name[..bytes.len()].copy_from_slice(bytes);
    // SAFETY: the socket is open and owned; `req` is a live `struct ifreq` whose
    // `ifr_data` points at `buf`, which is as long as the command's struct and
    // outlives the call.
    let rc = unsafe { libc::ioctl(sock.as_raw_fd(), SIOCETHTOOL, &mut req as *mut IfReqData) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn c_string(b: &[u8]) -> String {
    let end = b.iter().position(|c| *c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

/// Speed (Mb/s, 0 = unknown) and duplex of a `struct ethtool_cmd` buffer.
fn speed_duplex(cmd: &[u8; CMD_LEN]) -> (u32, String) {
    let speed = u32::from(u16::from_ne_bytes([cmd[12], cmd[13]]))
        | (u32::from(u16::from_ne_bytes([cmd[28], cmd[29]])) << 16);
    let speed = if speed == u32::MAX { 0 } else { speed };
    let duplex = match cmd[14] {
        0 => "half",
        1 => "full",
        _ => "",
    };
    (speed, duplex.to_owned())
}

/// What ethtool says of `name`, from a socket of the calling thread's namespace. A
/// driver without the operation (loopback, many virtual links) leaves fields empty.
pub(super) fn info(sock: &std::net::UdpSocket, name: &str) -> EthtoolInfo {
    let mut out = EthtoolInfo::default();
    let mut drv = [0u8; DRVINFO_LEN];
    drv[..4].copy_from_slice(&ETHTOOL_GDRVINFO.to_ne_bytes());
    if ethtool(sock, name, &mut drv).is_ok() {
        out.driver = c_string(&drv[4..36]);
    }
    let mut cmd = [0u8; CMD_LEN];
    cmd[..4].copy_from_slice(&ETHTOOL_GSET.to_ne_bytes());
    if ethtool(sock, name, &mut cmd).is_ok() {
        (out.speed_mbps, out.duplex) = speed_duplex(&cmd);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn speed_and_duplex_decode_and_unknown_is_empty() {
        let mut cmd = [0u8; CMD_LEN];
        cmd[12..14].copy_from_slice(&10_000u16.to_ne_bytes());
        cmd[14] = 1;
        assert_eq!(speed_duplex(&cmd), (10_000, "full".to_owned()));
        cmd[12..14].copy_from_slice(&0xffffu16.to_ne_bytes());
        cmd[28..30].copy_from_slice(&0xffffu16.to_ne_bytes());
        cmd[14] = 0xff;
        assert_eq!(speed_duplex(&cmd), (0, String::new()));
        cmd[12..14].copy_from_slice(&0x86a0u16.to_ne_bytes());
        cmd[28..30].copy_from_slice(&1u16.to_ne_bytes());
        assert_eq!(speed_duplex(&cmd).0, 100_000);
    }
}
