//! Test-only fault injection: lets an end-to-end test make a device thread panic,
//! stall or return, so that the process's supervision (the panic hook, the
//! [`watchdog`](super::watchdog)) and the node's restart of the process can be shown
//! to work on the real binary.
//!
//! The switch is the environment variable [`FAULT_ENV`], read once when the device
//! starts ([`init_from_env`]); nothing received from the network or the UAPI socket
//! can turn it on. Unset (the only state a deployment has), every hook is one
//! relaxed atomic load that finds nothing to do.

use std::{
    ops::ControlFlow,
    sync::atomic::{AtomicU8, Ordering},
};

/// The environment variable that names the fault (the test sets it on the child only).
pub const FAULT_ENV: &str = "WIRESPAN_WIREGUARD_FAULT";

/// A fault the device can be told to inject.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum InjectedFault {
    /// None: the device runs normally.
    None = 0,
    /// `panic-udp-on-datagram`: the UDP receiver panics on its first datagram.
    PanicUdpOnDatagram = 1,
    /// `stall-udp-on-datagram`: the UDP receiver stops making progress while holding
    /// its first batch of datagrams.
    StallUdpOnDatagram = 2,
    /// `return-udp-on-datagram`: the UDP receiver's loop returns on its first datagram.
    ReturnUdpOnDatagram = 3,
}

impl InjectedFault {
    /// The fault a value of [`FAULT_ENV`] names; `None` (the Rust one) for an unknown value.
    #[must_use]
    pub fn parse(text: &str) -> Option<Self> {
        match text.trim() {
            "" | "none" => Some(Self::None),
            "panic-udp-on-datagram" => Some(Self::PanicUdpOnDatagram),
            "stall-udp-on-datagram" => Some(Self::StallUdpOnDatagram),
            "return-udp-on-datagram" => Some(Self::ReturnUdpOnDatagram),
            _ => None,
        }
    }

    fn from_u8(v: u8) -> Self {
        match v {
            1 => Self::PanicUdpOnDatagram,
            2 => Self::StallUdpOnDatagram,
            3 => Self::ReturnUdpOnDatagram,
            _ => Self::None,
        }
    }
}

/// The fault of this process, set once at start.
static ACTIVE: AtomicU8 = AtomicU8::new(InjectedFault::None as u8);

/// Reads [`FAULT_ENV`] and arms the fault it names (an unknown name is logged and
/// ignored: a typo in a test must not pass for a working device). Returns the fault.
pub fn init_from_env() -> InjectedFault {
    let Ok(text) = std::env::var(FAULT_ENV) else {
        return InjectedFault::None;
    };
    let fault = InjectedFault::parse(&text).unwrap_or_else(|| {
        tracing::warn!(variable = FAULT_ENV, value = %text, "unknown fault, none injected");
        InjectedFault::None
    });
    if fault != InjectedFault::None {
        tracing::warn!(?fault, "test-only fault injection armed");
    }
    ACTIVE.store(fault as u8, Ordering::Relaxed);
    fault
}

/// Called by the UDP receiver with a batch in hand: injects the armed UDP fault.
/// `Break` asks the loop to return.
pub fn on_udp_batch() -> ControlFlow<()> {
    match InjectedFault::from_u8(ACTIVE.load(Ordering::Relaxed)) {
        InjectedFault::None => ControlFlow::Continue(()),
        InjectedFault::PanicUdpOnDatagram => {
            panic!("injected fault: {FAULT_ENV}=panic-udp-on-datagram")
        }
        InjectedFault::StallUdpOnDatagram => {
            tracing::warn!("injected fault: the UDP receiver stalls");
            // Parked for good (a spurious wake-up parks again): the batch is never done.
            loop {
                std::thread::park();
            }
        }
        InjectedFault::ReturnUdpOnDatagram => {
            tracing::warn!("injected fault: the UDP receiver returns");
            ControlFlow::Break(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_documented_names_arm_a_fault() {
        assert_eq!(
            InjectedFault::parse("panic-udp-on-datagram"),
            Some(InjectedFault::PanicUdpOnDatagram)
        );
        assert_eq!(
            InjectedFault::parse("stall-udp-on-datagram\n"),
            Some(InjectedFault::StallUdpOnDatagram)
        );
        assert_eq!(
            InjectedFault::parse("return-udp-on-datagram"),
            Some(InjectedFault::ReturnUdpOnDatagram)
        );
        assert_eq!(InjectedFault::parse(""), Some(InjectedFault::None));
        assert_eq!(InjectedFault::parse("panic"), None);
        for f in [
            InjectedFault::None,
            InjectedFault::PanicUdpOnDatagram,
            InjectedFault::StallUdpOnDatagram,
            InjectedFault::ReturnUdpOnDatagram,
        ] {
            assert_eq!(InjectedFault::from_u8(f as u8), f);
        }
    }
}
