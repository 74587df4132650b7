//! The remote API's certificates: the cluster API CA, client certificates carrying a
//! role, and node (server) certificates derived from the CA.
//!
//! The role is the certificate subject's organisation (`wirespan:admin`,
//! `wirespan:reader`, `wirespan:node`). Everything here is pure: the caller passes the
//! time in, and keys come back wrapped in [`SecretString`] so they cannot be printed by
//! accident.

use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

use crate::secret::SecretString;

/// Common name of the cluster API CA, followed by 12 hex digits of its key's SHA-256.
pub const CA_COMMON_NAME: &str = "wirespan cluster API CA";

/// How long the CA is valid (ten years).
pub const CA_LIFETIME: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// How long a client certificate is valid (one year).
pub const CLIENT_LIFETIME: Duration = Duration::from_secs(365 * 24 * 3600);
/// How long a node's server certificate is valid; renewed at two thirds of it
/// ([`renewal_due`]).
pub const NODE_LIFETIME: Duration = Duration::from_secs(7 * 24 * 3600);
/// Certificates start a little in the past, so that clock skew between the issuing
/// and the verifying host does not make a fresh certificate "not yet valid".
const BACKDATE: Duration = Duration::from_secs(300);

/// What a certificate's holder may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Every method, including mutating ones.
    Admin,
    /// Reading methods only.
    Reader,
    /// A node's own certificate: serves the API and forwards (proxies) requests to
    /// other nodes, passing the original caller's role on.
    Node,
}

impl Role {
    /// The certificate organisation that carries the role.
    #[must_use]
    pub fn organization(self) -> &'static str {
        match self {
            Self::Admin => "wirespan:admin",
            Self::Reader => "wirespan:reader",
            Self::Node => "wirespan:node",
        }
    }

    /// The role an organisation names.
    #[must_use]
    pub fn from_organization(org: &str) -> Option<Self> {
        [Self::Admin, Self::Reader, Self::Node]
            .into_iter()
            .find(|r| r.organization() == org)
    }

    /// The short name (`admin`, `reader`, `node`).
    #[must_use]
    pub fn as_str(self) -> &'static str {
        self.organization().trim_start_matches("wirespan:")
    }

    /// The role a short name names.
    #[must_use]
    pub fn parse(name: &str) -> Option<Self> {
        Self::from_organization(&format!("wirespan:{name}"))
    }
}

/// Making a certificate failed.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    /// Key or certificate generation (or the CA key not parsing).
    #[error("certificate generation: {0}")]
    Generate(#[from] rcgen::Error),
    /// A time outside what a certificate can hold.
    #[error("certificate validity: {0}")]
    Time(String),
}

/// A certificate and its private key, both PEM.
#[derive(Debug, Clone)]
pub struct Issued {
    /// The certificate (public).
    pub cert_pem: String,
    /// The private key.
    pub key_pem: SecretString,
    /// Start of validity.
    pub not_before: SystemTime,
    /// End of validity.
    pub not_after: SystemTime,
}

fn validity(
    params: &mut CertificateParams,
    now: SystemTime,
    lifetime: Duration,
) -> Result<(SystemTime, SystemTime), PkiError> {
    let not_before = now.checked_sub(BACKDATE).unwrap_or(now);
    let not_after = now + lifetime;
    let odt = |t: SystemTime| {
        let secs = t
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_err(|e| PkiError::Time(e.to_string()))?
            .as_secs();
        time::OffsetDateTime::from_unix_timestamp(i64::try_from(secs).unwrap_or(i64::MAX))
            .map_err(|e| PkiError::Time(e.to_string()))
    };
    params.not_before = odt(not_before)?;
    params.not_after = odt(not_after)?;
    Ok((not_before, not_after))
}

/// The CA's parameters; its name carries a fingerprint of its key, so two clusters'
/// CAs have different names (a certificate of the other is an unknown issuer) and a
/// node rebuilds the name from the key alone.
fn ca_params(key: &KeyPair) -> CertificateParams {
    use sha2::Digest as _;
    let fingerprint = sha2::Sha256::digest(key.public_key_raw());
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(
        DnType::CommonName,
        format!("{CA_COMMON_NAME} {}", hex_prefix(&fingerprint[..6])),
    );
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    params
}

/// A fresh cluster API CA, valid from `now` for [`CA_LIFETIME`].
///
/// # Errors
/// [`PkiError`].
pub fn generate_ca(now: SystemTime) -> Result<Issued, PkiError> {
    let key = KeyPair::generate()?;
    let mut params = ca_params(&key);
    let (not_before, not_after) = validity(&mut params, now, CA_LIFETIME)?;
    let cert = params.self_signed(&key)?;
    Ok(Issued {
        cert_pem: cert.pem(),
        key_pem: SecretString::new(key.serialize_pem()),
        not_before,
        not_after,
    })
}

/// Issues a certificate for `role` signed by the CA whose key is `ca_key_pem`:
/// common name `name`, organisation the role's, subject alternative names `sans` (DNS
/// names or IP addresses), usable both as a client and (for nodes) a server
/// certificate, valid from `now` for `lifetime`.
///
/// # Errors
/// [`PkiError`]; the CA key is never part of a message.
pub fn issue(
    ca_key_pem: &SecretString,
    role: Role,
    name: &str,
    sans: &[String],
    now: SystemTime,
    lifetime: Duration,
) -> Result<Issued, PkiError> {
    let ca_key = KeyPair::from_pem(ca_key_pem.expose())?;
    // The CA's name is fixed: re-signing its parameters with its key gives the issuer
    // (name and key identifier) that this certificate needs.
    let ca = ca_params(&ca_key).self_signed(&ca_key)?;
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(sans.to_vec())?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, name);
    dn.push(DnType::OrganizationName, role.organization());
    params.distinguished_name = dn;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    if role == Role::Node {
        params
            .extended_key_usages
            .push(ExtendedKeyUsagePurpose::ServerAuth);
    }
    let (not_before, not_after) = validity(&mut params, now, lifetime)?;
    let cert = params.signed_by(&key, &ca, &ca_key)?;
    Ok(Issued {
        cert_pem: cert.pem(),
        key_pem: SecretString::new(key.serialize_pem()),
        not_before,
        not_after,
    })
}

fn hex_prefix(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// True once two thirds of a certificate's validity have passed (or it is not valid
/// at all at `now`): the node then issues itself a new one.
#[must_use]
pub fn renewal_due(not_before: SystemTime, not_after: SystemTime, now: SystemTime) -> bool {
    let Ok(lifetime) = not_after.duration_since(not_before) else {
        return true;
    };
    now < not_before || now >= not_before + lifetime * 2 / 3
}

/// One DER element: its tag, its contents and what follows it.
fn der_element(buf: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = buf.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |acc, b| (acc << 8) | usize::from(*b));
        (len, &rest[n..])
    };
    (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
}

/// The organisation (O) of an X.509 certificate's subject, if it has one.
#[must_use]
pub fn organization_of(cert_der: &[u8]) -> Option<String> {
    subject_attribute(cert_der, &[0x55, 0x04, 0x0a])
}

/// The first subject attribute of an X.509 certificate with the (DER-encoded) `oid`,
/// as text.
#[must_use]
pub fn subject_attribute(cert_der: &[u8], oid_der: &[u8]) -> Option<String> {
    const SEQUENCE: u8 = 0x30;
    let (SEQUENCE, cert, _) = der_element(cert_der)? else {
        return None;
    };
    let (SEQUENCE, tbs, _) = der_element(cert)? else {
        return None;
    };
    let mut rest = tbs;
    // The explicit [0] version, when present.
    if rest.first() == Some(&0xa0) {
        rest = der_element(rest)?.2;
    }
    // Serial, signature algorithm, issuer, validity: then the subject.
    for _ in 0..4 {
        rest = der_element(rest)?.2;
    }
    let (SEQUENCE, mut rdns, _) = der_element(rest)? else {
        return None;
    };
    while let Some((_, set, next)) = der_element(rdns) {
        rdns = next;
        let Some((_, attr, _)) = der_element(set) else {
            continue;
        };
        let Some((0x06, oid, value)) = der_element(attr) else {
            continue;
        };
        if oid == oid_der {
            let (_, text, _) = der_element(value)?;
            return String::from_utf8(text.to_vec()).ok();
        }
    }
    None
}

/// The role a certificate carries in its organisation.
#[must_use]
pub fn role_of(cert_der: &[u8]) -> Option<Role> {
    Role::from_organization(&organization_of(cert_der)?)
}

/// The DER of the first certificate in a PEM text.
#[must_use]
pub fn first_cert_der(pem: &str) -> Option<Vec<u8>> {
    rustls_pemfile::certs(&mut pem.as_bytes())
        .next()?
        .ok()
        .map(|c| c.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn issued_certificates_carry_their_role() {
        let now = SystemTime::now();
        let ca = generate_ca(now).unwrap();
        assert!(ca.cert_pem.contains("BEGIN CERTIFICATE"));
        for role in [Role::Admin, Role::Reader, Role::Node] {
            let c = issue(
                &ca.key_pem,
                role,
                "n",
                &["node1".into(), "10.0.0.1".into()],
                now,
                CLIENT_LIFETIME,
            )
            .unwrap();
            let der = first_cert_der(&c.cert_pem).unwrap();
            assert_eq!(role_of(&der), Some(role));
            assert_eq!(Role::parse(role.as_str()), Some(role));
        }
        let ca_der = first_cert_der(&ca.cert_pem).unwrap();
        assert_eq!(organization_of(&ca_der), None, "the CA has no organisation");
        assert_eq!(organization_of(&[0x30, 0x05, 0x30]), None, "truncated");
        assert!(!format!("{:?}", ca.key_pem).contains("PRIVATE"));
    }

    #[test]
    fn renewal_is_due_at_two_thirds_of_the_lifetime() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let end = t0 + Duration::from_secs(300);
        assert!(!renewal_due(t0, end, t0));
        assert!(!renewal_due(t0, end, t0 + Duration::from_secs(199)));
        assert!(renewal_due(t0, end, t0 + Duration::from_secs(200)));
        assert!(renewal_due(t0, end, end + Duration::from_secs(1)));
        assert!(
            renewal_due(t0, end, t0 - Duration::from_secs(1)),
            "not yet valid"
        );
        assert!(renewal_due(end, t0, t0), "inverted validity");
    }
}
