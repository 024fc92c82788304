//! A minimal PNG writer (8-bit RGB) and an RGB canvas to draw on, with
//! horizontal and vertical lines, outlines and a 3×5 pixel font for printable ASCII
//! (lowercase drawn as uppercase).
//!
//! The image data is one zlib stream compressed by `miniz_oxide` (charts are mostly flat
//! colour and shrink about fiftyfold); the chunk CRC-32 is computed here.

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

    /// A horizontal line `w` pixels long starting at (x, y).
    pub fn hline(&mut self, x: usize, y: usize, w: usize, c: Rgb) {
        self.fill(x, y, w, 1, c);
    }

    /// A vertical line `h` pixels long starting at (x, y) and going down.
    pub fn vline(&mut self, x: usize, y: usize, h: usize, c: Rgb) {
        self.fill(x, y, 1, h, c);
    }

    /// The one-pixel outline of the `w` × `h` rectangle whose top-left corner is (x, y).
    pub fn outline(&mut self, x: usize, y: usize, w: usize, h: usize, c: Rgb) {
        if w == 0 || h == 0 {
            return;
        }
        self.hline(x, y, w, c);
        self.hline(x, y + h - 1, w, c);
        self.vline(x, y, h, c);
        self.vline(x + w - 1, y, h, c);
    }

    /// Draws `text` with its top-left corner at (x, y), each font pixel `scale` pixels wide;
    /// characters without a glyph are left blank.
    pub fn text(&mut self, x: usize, y: usize, text: &str, scale: usize, c: Rgb) {
        self.glyphs(
            text,
            scale,
            |along, across| Some((x + along, y + across)),
            c,
        );
    }

    /// Draws `text` turned a quarter turn anticlockwise, reading from bottom to top: the
    /// first character's lower-left corner is at (x, bottom), the tops of the glyphs face
    /// left, and it covers `text_width(text, scale)` rows above `bottom`.
    pub fn text_up(&mut self, x: usize, bottom: usize, text: &str, scale: usize, c: Rgb) {
        self.glyphs(
            text,
            scale,
            |along, across| Some((x + across, (bottom + 1).checked_sub(along + scale)?)),
            c,
        );
    }

    /// Fills one `scale`-sized square per lit font pixel, placed by `at`, which maps a
    /// position along the text and across it (both in canvas pixels, from the text's
    /// top-left corner) to the square's top-left corner, or to None above the canvas.
    fn glyphs(
        &mut self,
        text: &str,
        scale: usize,
        at: impl Fn(usize, usize) -> Option<(usize, usize)>,
        c: Rgb,
    ) {
        for (i, ch) in text.chars().enumerate() {
            let Some(rows) = glyph(ch) else {
                continue;
            };
            let left = i * (GLYPH_W + 1) * scale;
            for (gy, bits) in rows.iter().enumerate() {
                for gx in 0..GLYPH_W {
                    if bits & (1 << (GLYPH_W - 1 - gx)) != 0 {
                        if let Some((px, py)) = at(left + gx * scale, gy * scale) {
                            self.fill(px, py, scale, scale, c);
                        }
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

/// Rows of a 3×5 glyph, the high bit of the three on the left. Every printable ASCII
/// character has one (the space's is blank); lowercase letters share the capitals' glyphs,
/// and `×` has a small cross of its own.
fn glyph(ch: char) -> Option<[u8; GLYPH_H]> {
    Some(match ch.to_ascii_uppercase() {
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
        'A' => [0b010, 0b101, 0b111, 0b101, 0b101],
        'B' => [0b110, 0b101, 0b110, 0b101, 0b110],
        'C' => [0b011, 0b100, 0b100, 0b100, 0b011],
        'D' => [0b110, 0b101, 0b101, 0b101, 0b110],
        'E' => [0b111, 0b100, 0b110, 0b100, 0b111],
        'F' => [0b111, 0b100, 0b110, 0b100, 0b100],
        'G' => [0b011, 0b100, 0b101, 0b101, 0b011],
        'H' => [0b101, 0b101, 0b111, 0b101, 0b101],
        'I' => [0b111, 0b010, 0b010, 0b010, 0b111],
        'J' => [0b001, 0b001, 0b001, 0b101, 0b010],
        'K' => [0b101, 0b101, 0b110, 0b101, 0b101],
        'L' => [0b100, 0b100, 0b100, 0b100, 0b111],
        'M' => [0b101, 0b111, 0b111, 0b101, 0b101],
        'N' => [0b110, 0b101, 0b101, 0b101, 0b101],
        'O' => [0b010, 0b101, 0b101, 0b101, 0b010],
        'P' => [0b110, 0b101, 0b110, 0b100, 0b100],
        'Q' => [0b010, 0b101, 0b101, 0b110, 0b011],
        'R' => [0b110, 0b101, 0b110, 0b101, 0b101],
        'S' => [0b011, 0b100, 0b010, 0b001, 0b110],
        'T' => [0b111, 0b010, 0b010, 0b010, 0b010],
        'U' => [0b101, 0b101, 0b101, 0b101, 0b111],
        'V' => [0b101, 0b101, 0b101, 0b101, 0b010],
        'W' => [0b101, 0b101, 0b111, 0b111, 0b101],
        'X' => [0b101, 0b101, 0b010, 0b101, 0b101],
        'Y' => [0b101, 0b101, 0b010, 0b010, 0b010],
        'Z' => [0b111, 0b001, 0b010, 0b100, 0b111],
        ' ' => [0b000, 0b000, 0b000, 0b000, 0b000],
        '_' => [0b000, 0b000, 0b000, 0b000, 0b111],
        '/' => [0b001, 0b001, 0b010, 0b100, 0b100],
        '\\' => [0b100, 0b100, 0b010, 0b001, 0b001],
        ':' => [0b000, 0b010, 0b000, 0b010, 0b000],
        ';' => [0b000, 0b010, 0b000, 0b010, 0b100],
        ',' => [0b000, 0b000, 0b000, 0b010, 0b100],
        '(' => [0b001, 0b010, 0b010, 0b010, 0b001],
        ')' => [0b100, 0b010, 0b010, 0b010, 0b100],
        '[' => [0b011, 0b010, 0b010, 0b010, 0b011],
        ']' => [0b110, 0b010, 0b010, 0b010, 0b110],
        '{' => [0b011, 0b010, 0b110, 0b010, 0b011],
        '}' => [0b110, 0b010, 0b011, 0b010, 0b110],
        '<' => [0b001, 0b010, 0b100, 0b010, 0b001],
        '>' => [0b100, 0b010, 0b001, 0b010, 0b100],
        '%' => [0b101, 0b001, 0b010, 0b100, 0b101],
        '+' => [0b000, 0b010, 0b111, 0b010, 0b000],
        '=' => [0b000, 0b111, 0b000, 0b111, 0b000],
        '#' => [0b101, 0b111, 0b101, 0b111, 0b101],
        '*' => [0b101, 0b010, 0b111, 0b010, 0b101],
        '×' => [0b000, 0b101, 0b010, 0b101, 0b000],
        '!' => [0b010, 0b010, 0b010, 0b000, 0b010],
        '?' => [0b110, 0b001, 0b010, 0b000, 0b010],
        '\'' => [0b010, 0b010, 0b000, 0b000, 0b000],
        '"' => [0b101, 0b101, 0b000, 0b000, 0b000],
        '`' => [0b100, 0b010, 0b000, 0b000, 0b000],
        '^' => [0b010, 0b101, 0b000, 0b000, 0b000],
        '~' => [0b000, 0b001, 0b111, 0b100, 0b000],
        '|' => [0b010, 0b010, 0b010, 0b010, 0b010],
        '&' => [0b010, 0b101, 0b010, 0b101, 0b011],
        '@' => [0b010, 0b101, 0b111, 0b100, 0b011],
        '$' => [0b011, 0b110, 0b010, 0b011, 0b110],
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
    push_chunk(
        &mut out,
        b"IDAT",
        &miniz_oxide::deflate::compress_to_vec_zlib(&raw, 6),
    );
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_match_known_values() {
        assert_eq!(crc32(b""), 0);
        assert_eq!(crc32(b"123456789"), 0xcbf4_3926);
        assert_eq!(crc32(b"IEND"), 0xae42_6082);
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
        // The zlib stream (its Adler-32 included) inflates back to the filtered rows.
        let raw = miniz_oxide::inflate::decompress_to_vec_zlib(&chunks[1].1).expect("zlib stream");
        assert!(chunks[1].1.len() < raw.len() / 10, "flat colour compresses");
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
    fn every_printable_ascii_character_has_a_distinct_glyph() {
        let mut seen = std::collections::HashMap::new();
        for ch in ' '..='~' {
            let rows = glyph(ch).unwrap_or_else(|| panic!("no glyph for {ch:?}"));
            assert!(rows.iter().all(|r| *r < 8), "{ch:?} is 3 pixels wide");
            if ch.is_ascii_lowercase() {
                assert_eq!(Some(rows), glyph(ch.to_ascii_uppercase()));
                continue;
            }
            if let Some(other) = seen.insert(rows, ch) {
                panic!("{ch:?} and {other:?} look the same");
            }
        }
        assert!(glyph('×').is_some());
        assert!(glyph('é').is_none());
        // The digits keep the glyphs other drawings were made with.
        assert_eq!(glyph('0'), Some([0b111, 0b101, 0b101, 0b101, 0b111]));
        assert_eq!(glyph('.'), Some([0, 0, 0, 0, 0b010]));
    }

    #[test]
    fn upright_and_turned_text_light_the_same_pixels() {
        let ink = [0, 0, 0];
        let mut flat = Canvas::new(20, 8, [255; 3]);
        flat.text(1, 1, "F1", 1, ink);
        let mut up = Canvas::new(8, 20, [255; 3]);
        up.text_up(1, 18, "F1", 1, ink);
        // A quarter turn anticlockwise: upright (x, y) lands at (y, 19 - x) here.
        for y in 0..8 {
            for x in 0..20 {
                assert_eq!(flat.get(x, y), up.get(y, 19 - x), "pixel ({x}, {y})");
            }
        }
        // Text running off the top edge is clipped instead of wrapping around.
        up.text_up(0, 3, "LONG TEXT", 2, ink);
    }

    #[test]
    fn outlines() {
        let ink = [9, 9, 9];
        let mut o = Canvas::new(6, 6, [255; 3]);
        o.outline(1, 1, 4, 3, ink);
        assert_eq!(o.get(1, 1), ink);
        assert_eq!(o.get(4, 3), ink);
        assert_eq!(o.get(2, 2), [255; 3]);
        assert_eq!(o.get(5, 4), [255; 3]);
    }

    #[test]
    fn text_width_counts_glyphs_and_gaps() {
        assert_eq!(text_width("100", 2), 22);
        assert_eq!(text_width("", 2), 0);
    }
}
