//! serde helpers: bytes as standard base64 strings.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use serde::{Deserialize, Deserializer, Serializer};

pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&STANDARD.encode(bytes))
}

pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
    let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
    STANDARD
        .decode(s.as_bytes())
        .map_err(|e| serde::de::Error::custom(format!("invalid base64: {e}")))
}

pub mod option {
    use super::*;

    pub fn serialize<S: Serializer>(bytes: &Option<Vec<u8>>, s: S) -> Result<S::Ok, S::Error> {
        match bytes {
            Some(b) => super::serialize(b, s),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u8>>, D::Error> {
        let s = Option::<std::borrow::Cow<'de, str>>::deserialize(d)?;
        s.map(|s| {
            STANDARD
                .decode(s.as_bytes())
                .map_err(|e| serde::de::Error::custom(format!("invalid base64: {e}")))
        })
        .transpose()
    }
}
