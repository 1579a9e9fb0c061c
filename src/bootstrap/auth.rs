//! The optional shared secret: mutual challenge-response before anything
//! else is exchanged, so that a peer that does not know the secret learns
//! nothing (no region descriptors, no endpoint) and can do nothing.
//!
//! Both sides send a fresh 32-byte nonce (`challenge`), then a proof
//! `HMAC-SHA256(secret, label || role || verifier's nonce || prover's nonce)`
//! (`proof`), check the peer's in constant time, and say `accept` or
//! `reject`. The role byte keeps a proof from being reflected back at its
//! sender; fresh nonces keep one from being replayed. The secret itself
//! never crosses the wire.

use std::fmt;
use std::io::Read;
use std::net::TcpStream;
use std::sync::Arc;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::io::{Deadline, read_frame, send_reject, unexpected, write_frame};
use super::wire::FrameKind;
use crate::error::{AuthFailure, BootstrapError, Error, Result};

/// Bytes in a challenge nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes in a proof.
pub const PROOF_LEN: usize = 32;
const LABEL: &[u8] = b"gpu-rdma handshake proof v1";
/// The reason a side that finds the proofs disagree sends.
const MISMATCH: &str = "shared secret mismatch";

/// A shared secret for the handshake ([`ConnectOptions::secret`](crate::ConnectOptions::secret)).
/// Its bytes are never printed.
#[derive(Clone)]
pub struct Secret(Arc<[u8]>);

impl Secret {
    /// A secret from its bytes.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when it is empty.
    pub fn new(bytes: impl AsRef<[u8]>) -> Result<Secret> {
        let bytes = bytes.as_ref();
        if bytes.is_empty() {
            return Err(Error::InvalidArgument("an empty shared secret protects nothing".into()));
        }
        Ok(Secret(bytes.into()))
    }

    /// The secret in `GPU_RDMA_SECRET`, if that is set and not empty.
    pub fn from_env() -> Option<Secret> {
        std::env::var_os("GPU_RDMA_SECRET").and_then(|v| Secret::new(v.as_encoded_bytes()).ok())
    }

    fn mac(&self) -> Hmac<Sha256> {
        // HMAC takes keys of any length; this cannot fail.
        <Hmac<Sha256> as Mac>::new_from_slice(&self.0).unwrap_or_else(|_| unreachable!("HMAC accepts any key length"))
    }

    /// The proof that the side in `role` (true: the accepting side) knows
    /// the secret, answering `verifier_nonce`.
    fn proof_mac(&self, server: bool, verifier_nonce: &[u8], prover_nonce: &[u8]) -> Hmac<Sha256> {
        let mut m = self.mac();
        m.update(LABEL);
        m.update(&[u8::from(server)]);
        m.update(verifier_nonce);
        m.update(prover_nonce);
        m
    }

    /// This side's proof.
    pub fn prove(&self, server: bool, verifier_nonce: &[u8], prover_nonce: &[u8]) -> [u8; PROOF_LEN] {
        self.proof_mac(server, verifier_nonce, prover_nonce).finalize().into_bytes().into()
    }

    /// Checks the peer's proof, in constant time.
    pub fn verify(&self, server: bool, verifier_nonce: &[u8], prover_nonce: &[u8], proof: &[u8]) -> bool {
        self.proof_mac(server, verifier_nonce, prover_nonce).verify_slice(proof).is_ok()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// A fresh nonce from the kernel's random source.
fn nonce() -> Result<[u8; NONCE_LEN]> {
    let mut n = [0u8; NONCE_LEN];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut n)?;
    Ok(n)
}

fn auth(f: AuthFailure) -> Error {
    BootstrapError::Auth(f).into()
}

/// Reads the next frame, which must be `kind` with exactly `len` bytes.
fn expect(stream: &TcpStream, kind: FrameKind, len: usize, deadline: Deadline) -> Result<bytes::Bytes> {
    let (got, payload) = read_frame(stream, deadline, super::wire::MAX_REASON as u32)?;
    if got == FrameKind::Hello && kind == FrameKind::Challenge {
        send_reject(stream, "this side requires a shared secret");
        return Err(auth(AuthFailure::PeerHasNoSecret));
    }
    if got == FrameKind::Reject && kind != FrameKind::Challenge {
        // The peer found our proof wrong.
        return Err(auth(AuthFailure::SecretMismatch { detected_here: false }));
    }
    if got != kind {
        return Err(unexpected(kind.name(), got, &payload));
    }
    if payload.len() != len {
        return Err(BootstrapError::Malformed {
            what: kind.name(),
            detail: format!("{} bytes, expected {len}", payload.len()),
        }
        .into());
    }
    Ok(payload)
}

/// Runs the challenge-response with the peer; `server` is true on the
/// accepting side. Returns once both sides have accepted each other.
///
/// # Errors
/// [`BootstrapError::Auth`] when the secrets differ or the peer has none
/// (on both sides: the one that finds out tells the other); the errors of
/// [`read_frame`] for a silent, garbled or closing peer.
pub fn authenticate(stream: &TcpStream, secret: &Secret, server: bool, deadline: Deadline) -> Result<()> {
    let mine = nonce()?;
    write_frame(stream, FrameKind::Challenge, &mine, deadline.for_("sending the challenge"))?;
    let theirs = expect(stream, FrameKind::Challenge, NONCE_LEN, deadline.for_("the peer's challenge"))?;
    if theirs[..] == mine[..] {
        // Our own challenge reflected: not a peer that drew its own.
        send_reject(stream, MISMATCH);
        return Err(auth(AuthFailure::SecretMismatch { detected_here: true }));
    }
    let proof = secret.prove(server, &theirs, &mine);
    write_frame(stream, FrameKind::Proof, &proof, deadline.for_("sending the proof"))?;
    let their_proof = expect(stream, FrameKind::Proof, PROOF_LEN, deadline.for_("the peer's proof"))?;
    if !secret.verify(!server, &mine, &theirs, &their_proof) {
        send_reject(stream, MISMATCH);
        return Err(auth(AuthFailure::SecretMismatch { detected_here: true }));
    }
    write_frame(stream, FrameKind::Accept, &[], deadline.for_("sending accept"))?;
    expect(stream, FrameKind::Accept, 0, deadline.for_("the peer's verdict on our proof")).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_bind_the_secret_the_role_and_both_nonces() {
        let s = Secret::new("s3cret").unwrap();
        let (a, b) = ([1u8; 32], [2u8; 32]);
        let p = s.prove(true, &a, &b);
        assert!(s.verify(true, &a, &b, &p));
        assert!(!s.verify(false, &a, &b, &p), "reflected to the other role");
        assert!(!s.verify(true, &b, &a, &p), "nonces swapped");
        assert!(!s.verify(true, &a, &[3u8; 32], &p), "another nonce");
        assert!(!Secret::new("s3cres").unwrap().verify(true, &a, &b, &p), "another secret");
        assert!(!s.verify(true, &a, &b, &p[..31]), "truncated");
        assert!(Secret::new("").is_err());
        assert_eq!(format!("{s:?}"), "Secret(<redacted>)");
    }

    #[test]
    fn nonces_are_fresh() {
        assert_ne!(nonce().unwrap(), nonce().unwrap());
    }
}
