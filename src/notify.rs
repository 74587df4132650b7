//! The systemd readiness protocol (`sd_notify`), written out here rather than linking
//! libsystemd: one datagram of `KEY=VALUE` lines to the unix socket named by
//! `$NOTIFY_SOCKET` (a path, or `@name` for the abstract namespace). Units of
//! `Type=notify` wait for `READY=1` before they count as started.

use std::{io, os::unix::net::UnixDatagram, path::Path};

/// Sends `state` (e.g. `"READY=1"`) to the service manager. Without `$NOTIFY_SOCKET`
/// (not run by systemd, or not `Type=notify`) it does nothing and returns `Ok(false)`.
///
/// # Errors
/// The socket named by `$NOTIFY_SOCKET` cannot be reached.
pub fn notify(state: &str) -> io::Result<bool> {
    match std::env::var_os("NOTIFY_SOCKET") {
        Some(socket) if !socket.is_empty() => {
            send(&socket.to_string_lossy(), state)?;
            Ok(true)
        }
        _ => Ok(false),
    }
}

/// Sends `state` to the notify socket `socket` (`/path` or `@abstract`).
///
/// # Errors
/// Bad address, or the datagram could not be sent.
pub fn send(socket: &str, state: &str) -> io::Result<()> {
    let sock = UnixDatagram::unbound()?;
    if let Some(name) = socket.strip_prefix('@') {
        use std::os::linux::net::SocketAddrExt as _;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
        sock.send_to_addr(state.as_bytes(), &addr)?;
    } else if socket.starts_with('/') {
        sock.send_to(state.as_bytes(), Path::new(socket))?;
    } else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("NOTIFY_SOCKET {socket:?} is neither a path nor @abstract"),
        ));
    }
    Ok(())
}

/// [`notify`], logging instead of failing: readiness is a courtesy to the service
/// manager, never a reason for the daemon to stop.
pub fn notify_or_log(state: &str) {
    match notify(state) {
        Ok(true) => tracing::debug!(state, "notified the service manager"),
        Ok(false) => {}
        Err(e) => tracing::warn!(error = %e, state, "cannot notify the service manager"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recv(sock: &UnixDatagram) -> String {
        sock.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        let mut buf = [0u8; 256];
        let n = sock.recv(&mut buf).unwrap();
        String::from_utf8(buf[..n].to_vec()).unwrap()
    }

    #[test]
    fn ready_reaches_a_path_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let sock = UnixDatagram::bind(&path).unwrap();
        send(path.to_str().unwrap(), "READY=1").unwrap();
        assert_eq!(recv(&sock), "READY=1");
    }

    #[test]
    fn ready_reaches_an_abstract_socket() {
        use std::os::linux::net::SocketAddrExt as _;
        let name = format!("wirespan-notify-test-{}", std::process::id());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let sock = UnixDatagram::bind_addr(&addr).unwrap();
        send(&format!("@{name}"), "READY=1\nSTATUS=up").unwrap();
        assert_eq!(recv(&sock), "READY=1\nSTATUS=up");
    }

    #[test]
    fn a_relative_name_is_refused_and_an_unbound_socket_is_an_error() {
        assert_eq!(
            send("notify", "READY=1").unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
        let dir = tempfile::tempdir().unwrap();
        assert!(send(dir.path().join("none").to_str().unwrap(), "READY=1").is_err());
    }
}
