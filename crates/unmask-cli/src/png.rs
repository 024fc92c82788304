//! A minimal PNG writer (8-bit RGB, no compression) and an RGB canvas to draw on, with a
//! 3×5 pixel font for digits.
//!
//! The image data goes into one zlib stream made of stored deflate blocks, so the encoder
//! needs only CRC-32 (per chunk) and Adler-32 (per zlib stream), both computed here.

/// An RGB image, rows top to bottom, 3 bytes per pixel.
#[derive(Clone, Debug)]
pub struct Canvas {
    pub width: usize,
    pub height: usize,
    pub pixels: Vec<u8>,
}

pub type Rgb = [u8; 3];

impl Canvas {
    pub fn new(width: usize, height: usize, background: Rgb) -> Self {
        let mut pixels = Vec::with_capacity(width * height * 3);
        for _ in 0..width * height {
            pixels.extend_from_slice(&background);
        }
        Self {
            width,
            height,
            pixels,
        }
    }

    /// Sets one pixel; pixels outside the canvas are ignored.
    pub fn set(&mut self, x: usize, y: usize, c: Rgb) {
        if x < self.width && y < self.height {
            let at = (y * self.width + x) * 3;
            self.pixels[at..at + 3].copy_from_slice(&c);
        }
    }

    #[cfg(test)]
    pub fn get(&self, x: usize, y: usize) -> Rgb {
        let at = (y * self.width + x) * 3;
        [self.pixels[at], self.pixels[at + 1], self.pixels[at + 2]]
    }

    pub fn fill(&mut self, x: usize, y: usize, w: usize, h: usize, c: Rgb) {
        for yy in y..y + h {
            for xx in x..x + w {
                self.set(xx, yy, c);
            }
        }
    }

    /// Draws `text` with its top-left corner at (x, y), each font pixel `scale` pixels wide;
    /// characters without a glyph are left blank.
    pub fn text(&mut self, x: usize, y: usize, text: &str, scale: usize, c: Rgb) {
        for (i, ch) in text.chars().enumerate() {
            let Some(rows) = glyph(ch) else {
                continue;
            };
            let left = x + i * (GLYPH_W + 1) * scale;
            for (gy, bits) in rows.iter().enumerate() {
                for gx in 0..GLYPH_W {
                    if bits & (1 << (GLYPH_W - 1 - gx)) != 0 {
                        self.fill(left + gx * scale, y + gy * scale, scale, scale, c);
                    }
                }
            }
        }
    }

    /// The PNG file of this image.
    pub fn to_png(&self) -> Vec<u8> {
        encode_png(self.width, self.height, &self.pixels)
    }
}

pub const GLYPH_W: usize = 3;
pub const GLYPH_H: usize = 5;

/// Width in pixels of `text` drawn at `scale`.
pub fn text_width(text: &str, scale: usize) -> usize {
    let n = text.chars().count();
    if n == 0 {
        0
    } else {
        (n * (GLYPH_W + 1) - 1) * scale
    }
}

/// Rows of a 3×5 glyph, the high bit of the three on the left.
fn glyph(ch: char) -> Option<[u8; GLYPH_H]> {
    Some(match ch {
        '0' => [0b111, 0b101, 0b101, 0b101, 0b111],
        '1' => [0b010, 0b110, 0b010, 0b010, 0b111],
        '2' => [0b111, 0b001, 0b111, 0b100, 0b111],
        '3' => [0b111, 0b001, 0b111, 0b001, 0b111],
        '4' => [0b101, 0b101, 0b111, 0b001, 0b001],
        '5' => [0b111, 0b100, 0b111, 0b001, 0b111],
        '6' => [0b111, 0b100, 0b111, 0b101, 0b111],
        '7' => [0b111, 0b001, 0b001, 0b001, 0b001],
        '8' => [0b111, 0b101, 0b111, 0b101, 0b111],
        '9' => [0b111, 0b101, 0b111, 0b001, 0b111],
        '.' => [0b000, 0b000, 0b000, 0b000, 0b010],
        '-' => [0b000, 0b000, 0b111, 0b000, 0b000],
        _ => return None,
    })
}

pub const PNG_SIGNATURE: [u8; 8] = [0x89, b'P', b'N', b'G', b'\r', b'\n', 0x1a, b'\n'];

/// A PNG of `width` × `height` RGB pixels (`rgb.len() == width * height * 3`).
pub fn encode_png(width: usize, height: usize, rgb: &[u8]) -> Vec<u8> {
    assert_eq!(rgb.len(), width * height * 3, "RGB buffer size");
    let mut ihdr = Vec::with_capacity(13);
    ihdr.extend_from_slice(&(width as u32).to_be_bytes());
    ihdr.extend_from_slice(&(height as u32).to_be_bytes());
    // Bit depth 8, colour type 2 (RGB), deflate, adaptive filtering, no interlace.
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
    // Every scanline starts with its filter type: 0, none.
    let mut raw = Vec::with_capacity(height * (width * 3 + 1));
    for row in rgb.chunks_exact(width * 3).take(height) {
        raw.push(0);
        raw.extend_from_slice(row);
    }
    let mut out = PNG_SIGNATURE.to_vec();
    push_chunk(&mut out, b"IHDR", &ihdr);
    push_chunk(&mut out, b"IDAT", &zlib_stored(&raw));
    push_chunk(&mut out, b"IEND", &[]);
    out
}

/// Length, type, data and the CRC-32 of type and data.
fn push_chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    let start = out.len();
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    let crc = crc32(&out[start..]);
    out.extend_from_slice(&crc.to_be_bytes());
}

/// A zlib stream holding `data` in stored deflate blocks (at most 65535 bytes each).
pub fn zlib_stored(data: &[u8]) -> Vec<u8> {
    const MAX_BLOCK: usize = 65535;
    // CMF: deflate with a 32 KiB window; FLG: no dictionary, check bits so that
    // (CMF * 256 + FLG) % 31 == 0.
    let mut out = vec![0x78, 0x01];
    let mut blocks = data.chunks(MAX_BLOCK).peekable();
    if blocks.peek().is_none() {
        out.extend_from_slice(&[1, 0, 0, 0xff, 0xff]);
    }
    while let Some(block) = blocks.next() {
        let last = blocks.peek().is_none();
        // BFINAL in bit 0, BTYPE = 00 (stored) in bits 1-2; the rest of the byte is padding.
        out.push(u8::from(last));
        let len = block.len() as u16;
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(&(!len).to_le_bytes());
        out.extend_from_slice(block);
    }
    out.extend_from_slice(&adler32(data).to_be_bytes());
    out
}

/// CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320), as PNG chunks use.
pub fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = 0xffff_ffffu32;
    for &b in bytes {
        crc ^= b as u32;
        for _ in 0..8 {
            let mask = (crc & 1).wrapping_neg();
            crc = (crc >> 1) ^ (0xedb8_8320 & mask);
        }
    }
    !crc
}

/// Adler-32, the checksum at the end of a zlib stream.
pub fn adler32(bytes: &[u8]) -> u32 {
    const MOD: u32 = 65521;
    let (mut a, mut b) = (1u32, 0u32);
    // 5552 bytes is the most that can be summed before b could overflow a u32.
    for chunk in bytes.chunks(5552) {
        for &x in chunk {
            a += x as u32;
            b += a;
        }
        a %= MOD;
        b %= MOD;
    }
    (b << 16) | a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_match_known_values() {
        assert_eq!(crc32(b""), 0);
        assert_eq!(crc32(b"123456789"), 0xcbf4_3926);
        assert_eq!(crc32(b"IEND"), 0xae42_6082);
        assert_eq!(adler32(b""), 1);
        assert_eq!(adler32(b"Wikipedia"), 0x11e6_0398);
        // Long input exercises the deferred modulo.
        let long = vec![0xffu8; 100_000];
        let (mut a, mut b) = (1u64, 0u64);
        for &x in &long {
            a = (a + x as u64) % 65521;
            b = (b + a) % 65521;
        }
        assert_eq!(adler32(&long), ((b << 16) | a) as u32);
    }

    /// The chunks of a PNG file: (type, data), each CRC checked.
    fn chunks(png: &[u8]) -> Vec<([u8; 4], Vec<u8>)> {
        assert_eq!(&png[..8], &PNG_SIGNATURE);
        let mut at = 8;
        let mut out = Vec::new();
        while at < png.len() {
            let len = u32::from_be_bytes(png[at..at + 4].try_into().unwrap()) as usize;
            let kind: [u8; 4] = png[at + 4..at + 8].try_into().unwrap();
            let data = png[at + 8..at + 8 + len].to_vec();
            let crc = u32::from_be_bytes(png[at + 8 + len..at + 12 + len].try_into().unwrap());
            assert_eq!(crc, crc32(&png[at + 4..at + 8 + len]), "CRC of {kind:?}");
            out.push((kind, data));
            at += 12 + len;
        }
        assert_eq!(at, png.len());
        out
    }

    /// Inflates a zlib stream of stored blocks, checking the header and Adler-32.
    fn unstore(z: &[u8]) -> Vec<u8> {
        assert_eq!((z[0] as u16 * 256 + z[1] as u16) % 31, 0, "zlib check bits");
        assert_eq!(z[0] & 0x0f, 8, "deflate");
        let mut at = 2;
        let mut out = Vec::new();
        loop {
            let header = z[at];
            assert_eq!(header & 0b110, 0, "stored block");
            let len = u16::from_le_bytes([z[at + 1], z[at + 2]]);
            let nlen = u16::from_le_bytes([z[at + 3], z[at + 4]]);
            assert_eq!(len, !nlen);
            out.extend_from_slice(&z[at + 5..at + 5 + len as usize]);
            at += 5 + len as usize;
            if header & 1 == 1 {
                break;
            }
        }
        let adler = u32::from_be_bytes(z[at..at + 4].try_into().unwrap());
        assert_eq!(adler, adler32(&out));
        assert_eq!(at + 4, z.len());
        out
    }

    #[test]
    fn png_header_chunks_and_pixels_decode() {
        let (w, h) = (300, 250);
        let mut c = Canvas::new(w, h, [255, 255, 255]);
        c.fill(10, 20, 5, 5, [1, 2, 3]);
        c.text(100, 100, "0.97", 2, [0, 0, 0]);
        let png = c.to_png();
        let chunks = chunks(&png);
        let kinds: Vec<&[u8; 4]> = chunks.iter().map(|c| &c.0).collect();
        assert_eq!(kinds, [b"IHDR", b"IDAT", b"IEND"]);
        let ihdr = &chunks[0].1;
        assert_eq!(ihdr.len(), 13);
        assert_eq!(u32::from_be_bytes(ihdr[0..4].try_into().unwrap()), w as u32);
        assert_eq!(u32::from_be_bytes(ihdr[4..8].try_into().unwrap()), h as u32);
        assert_eq!(&ihdr[8..], &[8, 2, 0, 0, 0]);
        // 250 rows of 901 bytes need four stored blocks.
        let raw = unstore(&chunks[1].1);
        assert_eq!(raw.len(), h * (w * 3 + 1));
        for (y, row) in raw.chunks_exact(w * 3 + 1).enumerate() {
            assert_eq!(row[0], 0, "filter of row {y}");
            assert_eq!(&row[1..], &c.pixels[y * w * 3..(y + 1) * w * 3]);
        }
        assert_eq!(c.get(12, 22), [1, 2, 3]);
        assert_eq!(c.get(9, 22), [255, 255, 255]);
        assert!(chunks[2].1.is_empty());
    }

    #[test]
    fn empty_streams_and_text_width() {
        assert_eq!(unstore(&zlib_stored(&[])), Vec::<u8>::new());
        let exact = vec![7u8; 65535];
        assert_eq!(unstore(&zlib_stored(&exact)), exact);
        assert_eq!(text_width("100", 2), 22);
        assert_eq!(text_width("", 2), 0);
    }
}
