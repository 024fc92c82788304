//! Writing a little-endian f32 matrix as a NumPy `.npy` file (format version 1.0).

use std::io::{self, Write};

const MAGIC: &[u8] = b"\x93NUMPY";

/// The bytes before the data: magic, version 1.0, header length (u16 LE) and the header
/// dict, padded with spaces and ended by a newline so the data starts on a 64-byte boundary.
pub fn header(shape: &[usize]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_text = match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    };
    let mut dict = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape_text}, }}");
    let fixed = MAGIC.len() + 2 + 2;
    let unpadded = fixed + dict.len() + 1;
    let padding = unpadded.next_multiple_of(64) - unpadded;
    dict.push_str(&" ".repeat(padding));
    dict.push('\n');
    let mut out = Vec::with_capacity(fixed + dict.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[1, 0]);
    out.extend_from_slice(&(dict.len() as u16).to_le_bytes());
    out.extend_from_slice(dict.as_bytes());
    out
}

/// Writes `data` (row-major, `shape.iter().product()` values) as an f32 `.npy` array.
pub fn write_f32(out: &mut impl Write, shape: &[usize], data: &[f32]) -> io::Result<()> {
    let expected: usize = shape.iter().product();
    if data.len() != expected {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "npy: shape {shape:?} holds {expected} values, found {}",
                data.len()
            ),
        ));
    }
    out.write_all(&header(shape))?;
    let mut bytes = Vec::with_capacity(data.len() * 4);
    for v in data {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    out.write_all(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_is_aligned_and_parsable() {
        for shape in [vec![3, 320], vec![12345, 126464], vec![7]] {
            let h = header(&shape);
            assert_eq!(h.len() % 64, 0);
            assert_eq!(&h[..8], b"\x93NUMPY\x01\x00");
            let len = u16::from_le_bytes([h[8], h[9]]) as usize;
            assert_eq!(len + 10, h.len());
            let text = std::str::from_utf8(&h[10..]).unwrap();
            assert!(text.ends_with('\n'));
            assert!(text.starts_with("{'descr': '<f4', 'fortran_order': False, 'shape': ("));
        }
        let text = String::from_utf8(header(&[3, 320])[10..].to_vec()).unwrap();
        assert!(text.contains("'shape': (3, 320), }"));
        let text = String::from_utf8(header(&[7])[10..].to_vec()).unwrap();
        assert!(text.contains("'shape': (7,), }"));
    }

    #[test]
    fn data_follows_header() {
        let mut buf = Vec::new();
        write_f32(&mut buf, &[2, 2], &[1.0, -2.0, 0.5, 3.0]).unwrap();
        let h = header(&[2, 2]).len();
        assert_eq!(buf.len(), h + 16);
        assert_eq!(&buf[h..h + 4], &1.0f32.to_le_bytes());
        assert!(write_f32(&mut Vec::new(), &[2, 2], &[1.0]).is_err());
    }
}
