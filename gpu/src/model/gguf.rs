//! GGUF reader: header, metadata and tensor directory of a `.gguf` file.
//!
//! The whole file is read into memory once; tensors are then byte ranges of
//! it. Every length and offset is checked against the file size, so a
//! truncated or corrupt file is an error naming what is wrong, never a panic.

use std::collections::HashMap;
use std::path::Path;

use super::ModelError;
use super::dtype::DType;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;

/// One metadata value.
#[derive(Debug, Clone)]
pub enum MetaValue {
    /// Any unsigned integer type.
    Uint(u64),
    /// Any signed integer type.
    Int(i64),
    /// `f32` or `f64`.
    Float(f64),
    /// Boolean.
    Bool(bool),
    /// UTF-8 string (invalid bytes replaced).
    Str(String),
    /// Array of values.
    Array(Vec<MetaValue>),
}

impl MetaValue {
    /// The value as an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::Uint(v) => Some(v),
            MetaValue::Int(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, if it is numeric.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::Float(v) => Some(v),
            MetaValue::Uint(v) => Some(v as f64),
            MetaValue::Int(v) => Some(v as f64),
            _ => None,
        }
    }

    /// The value as a string slice.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The value as a boolean.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }
}

/// Where one tensor lives in the file.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    /// Element type.
    pub dtype: DType,
    /// Dimensions, innermost first (ggml order: `[columns, rows]`).
    pub dims: Vec<usize>,
    /// Absolute byte range in the file.
    pub range: std::ops::Range<usize>,
}

/// A parsed GGUF file.
pub struct GgufFile {
    /// File path, for error messages.
    pub path: String,
    /// Metadata by key.
    pub metadata: HashMap<String, MetaValue>,
    /// Tensor directory by name.
    pub tensors: HashMap<String, TensorInfo>,
    /// The file's bytes.
    pub bytes: Vec<u8>,
}

struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
    path: &'a str,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], ModelError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        let Some(end) = end else {
            return Err(ModelError::malformed(
                self.path,
                format!("file ends at byte {} while reading {n} more bytes of the header", self.bytes.len()),
            ));
        };
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8, ModelError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, ModelError> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Result<u32, ModelError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64, ModelError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    fn len(&mut self) -> Result<usize, ModelError> {
        let n = self.u64()?;
        usize::try_from(n)
            .ok()
            .filter(|&n| n <= self.bytes.len())
            .ok_or_else(|| ModelError::malformed(self.path, format!("length {n} is larger than the file")))
    }

    fn string(&mut self) -> Result<String, ModelError> {
        let n = self.len()?;
        Ok(String::from_utf8_lossy(self.take(n)?).into_owned())
    }

    fn value(&mut self, kind: u32, depth: usize) -> Result<MetaValue, ModelError> {
        Ok(match kind {
            0 => MetaValue::Uint(self.u8()? as u64),
            1 => MetaValue::Int(self.u8()? as i8 as i64),
            2 => MetaValue::Uint(self.u16()? as u64),
            3 => MetaValue::Int(self.u16()? as i16 as i64),
            4 => MetaValue::Uint(self.u32()? as u64),
            5 => MetaValue::Int(self.u32()? as i32 as i64),
            6 => MetaValue::Float(f32::from_bits(self.u32()?) as f64),
            7 => MetaValue::Bool(self.u8()? != 0),
            8 => MetaValue::Str(self.string()?),
            9 if depth < 4 => {
                let inner = self.u32()?;
                let n = self.len()?;
                let mut items = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    items.push(self.value(inner, depth + 1)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::Uint(self.u64()?),
            11 => MetaValue::Int(self.u64()? as i64),
            12 => MetaValue::Float(f64::from_bits(self.u64()?)),
            other => {
                return Err(ModelError::malformed(self.path, format!("unknown metadata value type {other}")));
            }
        })
    }
}

impl GgufFile {
    /// Reads and parses a GGUF file.
    pub fn open(path: &Path) -> Result<GgufFile, ModelError> {
        let shown = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|source| ModelError::Io { path: shown.clone(), source })?;
        Self::parse(shown, bytes)
    }

    /// Parses GGUF bytes; `path` is used in error messages only.
    pub fn parse(path: String, bytes: Vec<u8>) -> Result<GgufFile, ModelError> {
        let mut c = Cursor { bytes: &bytes, at: 0, path: &path };
        if c.take(4)? != MAGIC {
            return Err(ModelError::malformed(&path, "not a GGUF file (missing the GGUF magic bytes)"));
        }
        let version = c.u32()?;
        if !(2..=3).contains(&version) {
            return Err(ModelError::malformed(&path, format!("GGUF version {version} is not supported (2 or 3 are)")));
        }
        let tensor_count = c.len()?;
        let kv_count = c.len()?;
        let mut metadata = HashMap::new();
        for _ in 0..kv_count {
            let key = c.string()?;
            let kind = c.u32()?;
            let value = c.value(kind, 0)?;
            metadata.insert(key, value);
        }
        let mut directory = Vec::with_capacity(tensor_count.min(1 << 16));
        for _ in 0..tensor_count {
            let name = c.string()?;
            let n_dims = c.u32()? as usize;
            if n_dims == 0 || n_dims > 4 {
                return Err(ModelError::malformed(&path, format!("tensor {name} has {n_dims} dimensions")));
            }
            let mut dims = Vec::with_capacity(n_dims);
            for _ in 0..n_dims {
                dims.push(c.len()?);
            }
            let kind = c.u32()?;
            let offset = c.u64()?;
            directory.push((name, dims, kind, offset));
        }
        let alignment = metadata
            .get("general.alignment")
            .and_then(MetaValue::as_u64)
            .filter(|&a| a > 0)
            .unwrap_or(DEFAULT_ALIGNMENT);
        let data_start = (c.at as u64).div_ceil(alignment) * alignment;
        let mut tensors = HashMap::new();
        for (name, dims, kind, offset) in directory {
            let Some(dtype) = DType::from_ggml(kind) else {
                return Err(ModelError::UnsupportedTensorType {
                    path: path.clone(),
                    tensor: name,
                    dtype: DType::ggml_name(kind).to_string(),
                });
            };
            let elems = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
            let size = elems.filter(|&e| dims[0] % dtype.block_elems() == 0 && e > 0).and_then(|e| dtype.bytes_for(e));
            let Some(size) = size else {
                return Err(ModelError::malformed(
                    &path,
                    format!("tensor {name} has shape {dims:?}, which {dtype:?} cannot hold"),
                ));
            };
            let start = data_start.checked_add(offset).and_then(|s| usize::try_from(s).ok());
            let range = start.and_then(|s| s.checked_add(size).map(|e| s..e)).filter(|r| r.end <= bytes.len());
            let Some(range) = range else {
                return Err(ModelError::malformed(
                    &path,
                    format!("tensor {name} lies past the end of the file (is the download truncated?)"),
                ));
            };
            tensors.insert(name, TensorInfo { dtype, dims, range });
        }
        Ok(GgufFile { path, metadata, tensors, bytes })
    }

    /// A metadata value by key.
    pub fn meta(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    /// A required unsigned integer metadata value.
    pub fn meta_usize(&self, key: &str) -> Result<usize, ModelError> {
        self.meta(key).and_then(MetaValue::as_u64).and_then(|v| usize::try_from(v).ok()).ok_or_else(|| {
            ModelError::malformed(&self.path, format!("metadata key {key} is missing or not an integer"))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_a_file_that_is_not_gguf() {
        let err = GgufFile::parse("x.gguf".into(), b"PK\x03\x04rest".to_vec()).err().map(|e| e.to_string());
        assert!(err.is_some_and(|e| e.contains("x.gguf") && e.contains("magic")));
    }

    #[test]
    fn rejects_a_truncated_header() {
        let mut bytes = b"GGUF".to_vec();
        bytes.extend_from_slice(&3u32.to_le_bytes());
        bytes.extend_from_slice(&1u64.to_le_bytes());
        let err = GgufFile::parse("t.gguf".into(), bytes).err().map(|e| e.to_string());
        assert!(err.is_some_and(|e| e.contains("t.gguf")));
    }
}
