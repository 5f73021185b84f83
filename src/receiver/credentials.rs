//! The receiver's credentials: the bearer token it checks and the TLS certificate it
//! serves with.

use std::{path::Path, sync::Arc};

use tokio_rustls::TlsAcceptor;

use crate::{
    config::{ReceiverAuth, Settings},
    error::{Error, Result},
};

/// Equality of two byte strings in time that depends on their lengths only.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

/// The bearer token of the settings: None with `alert_receiver_auth = "off"`; otherwise
/// the content of `alert_receiver_token_file`, without a trailing newline. An unset,
/// unreadable or empty file is an [`Error::Setting`] naming the setting.
pub fn read_token(settings: &Settings) -> Result<Option<Vec<u8>>> {
    if settings.alert_receiver_auth == ReceiverAuth::Off {
        return Ok(None);
    }
    let bad = |reason: String| Error::Setting {
        name: "alert_receiver_token_file".into(),
        reason,
    };
    let path =
        settings
            .alert_receiver_token_file
            .as_deref()
            .ok_or_else(|| {
                bad("not set, and alert_receiver_auth is \"token\": name a file holding the bearer \
             token, or set alert_receiver_auth = \"off\""
            .into())
            })?;
    let text =
        std::fs::read(path).map_err(|e| bad(format!("cannot read {}: {e}", path.display())))?;
    let token = text.trim_ascii_end();
    if token.is_empty() {
        return Err(bad(format!("{} is empty", path.display())));
    }
    if token.iter().any(|b| !b.is_ascii_graphic()) {
        return Err(bad(format!(
            "{} holds whitespace or non-ASCII bytes; a bearer token is printable ASCII",
            path.display()
        )));
    }
    Ok(Some(token.to_vec()))
}

/// The TLS acceptor of `alert_receiver_tls_cert_file` and `alert_receiver_tls_key_file`,
/// or None when they are not set. Uses rustls with the ring provider.
pub fn tls_acceptor(settings: &Settings) -> Result<Option<TlsAcceptor>> {
    use rustls::pki_types::{pem::PemObject, CertificateDer, PrivateKeyDer};
    let (Some(cert), Some(key)) = (
        &settings.alert_receiver_tls_cert_file,
        &settings.alert_receiver_tls_key_file,
    ) else {
        return Ok(None);
    };
    let bad = |name: &'static str, path: &Path, why: String| Error::Setting {
        name: name.into(),
        reason: format!("{}: {why}", path.display()),
    };
    let certs = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<std::result::Result<Vec<_>, _>>())
        .map_err(|e| bad("alert_receiver_tls_cert_file", cert, e.to_string()))?;
    if certs.is_empty() {
        return Err(bad(
            "alert_receiver_tls_cert_file",
            cert,
            "no certificate in the file".into(),
        ));
    }
    let key_der = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| bad("alert_receiver_tls_key_file", key, e.to_string()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .and_then(|b| b.with_no_client_auth().with_single_cert(certs, key_der))
        .map_err(|e| bad("alert_receiver_tls_key_file", key, e.to_string()))?;
    Ok(Some(TlsAcceptor::from(Arc::new(config))))
}
