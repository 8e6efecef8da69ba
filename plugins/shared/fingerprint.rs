//! A 128-bit FNV-1a fingerprint over length-prefixed fields, shared by the
//! reference plugins (each includes this file with `#[path]`). Keys built
//! from it are the same in every instance and replica, and two different
//! lists of fields never feed it the same bytes.

/// An FNV-1a 128 hasher; feed it with [`Fingerprint::field`].
pub struct Fingerprint(u128);

impl Fingerprint {
    const OFFSET: u128 = 0x6c62_272e_07bb_0142_62b8_2175_6295_c58d;
    const PRIME: u128 = 0x0000_0000_0100_0000_0000_0000_0000_013b;

    /// An empty fingerprint.
    pub fn new() -> Self {
        Self(Self::OFFSET)
    }

    /// Adds one field (its length, then its bytes).
    pub fn field(&mut self, bytes: &[u8]) -> &mut Self {
        self.bytes(&(bytes.len() as u64).to_le_bytes());
        self.bytes(bytes);
        self
    }

    /// The fingerprint as 32 lower-case hex digits.
    pub fn hex(&self) -> String {
        format!("{:032x}", self.0)
    }

    fn bytes(&mut self, bytes: &[u8]) {
        for byte in bytes {
            self.0 = (self.0 ^ u128::from(*byte)).wrapping_mul(Self::PRIME);
        }
    }
}

impl Default for Fingerprint {
    fn default() -> Self {
        Self::new()
    }
}
