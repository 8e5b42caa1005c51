//! `fdpblk simulate --plot`: WAF vs utilisation per policy as a PNG, with no dependency beyond
//! `crc32fast`: an indexed-colour raster, a 5×7 bitmap font, and a zlib stream of fixed-Huffman
//! deflate blocks whose matches repeat the previous pixel or the row above (plots are mostly
//! flat colour, so that is enough for a small file).

use super::run::RunResult;
use std::path::Path;

const PALETTE: [[u8; 3]; 12] = [
    [255, 255, 255], // 0 background
    [0, 0, 0],       // 1 axes, text
    [215, 215, 215], // 2 grid
    [120, 120, 120], // 3 secondary text
    [214, 39, 40],   // series: red
    [31, 119, 180],  // blue
    [44, 160, 44],   // green
    [148, 103, 189], // purple
    [255, 127, 14],  // orange
    [140, 86, 75],   // brown
    [227, 119, 194], // pink
    [23, 190, 207],  // cyan
];

/// An indexed-colour image.
pub struct Canvas {
    pub w: usize,
    pub h: usize,
    px: Vec<u8>,
}

impl Canvas {
    pub fn new(w: usize, h: usize) -> Self {
        Canvas { w, h, px: vec![0; w * h] }
    }
    pub fn set(&mut self, x: i64, y: i64, c: u8) {
        if x >= 0 && y >= 0 && (x as usize) < self.w && (y as usize) < self.h {
            self.px[y as usize * self.w + x as usize] = c;
        }
    }
    pub fn get(&self, x: usize, y: usize) -> u8 {
        self.px[y * self.w + x]
    }
    pub fn rect(&mut self, x0: i64, y0: i64, x1: i64, y1: i64, c: u8) {
        for y in y0.min(y1)..=y0.max(y1) {
            for x in x0.min(x1)..=x0.max(x1) {
                self.set(x, y, c);
            }
        }
    }
    /// A line `thick` pixels wide; with `dash`, drawn `dash` pixels on, `dash` off.
    #[allow(clippy::too_many_arguments)] // two end points, a colour and a pen: all plain numbers
    pub fn line(&mut self, x0: i64, y0: i64, x1: i64, y1: i64, c: u8, thick: i64, dash: i64) {
        let (dx, dy) = ((x1 - x0).abs(), -(y1 - y0).abs());
        let (sx, sy) = (if x0 < x1 { 1 } else { -1 }, if y0 < y1 { 1 } else { -1 });
        let (mut x, mut y, mut err) = (x0, y0, dx + dy);
        let mut step = 0i64;
        loop {
            if dash == 0 || (step / dash) % 2 == 0 {
                self.rect(x - thick / 2, y - thick / 2, x + (thick - 1) / 2, y + (thick - 1) / 2, c);
            }
            step += 1;
            if x == x1 && y == y1 {
                break;
            }
            let e2 = 2 * err;
            if e2 >= dy {
                err += dy;
                x += sx;
            }
            if e2 <= dx {
                err += dx;
                y += sy;
            }
        }
    }
    /// Text at (x, y) (top left), glyphs scaled by `s`; returns the width drawn.
    pub fn text(&mut self, x: i64, y: i64, t: &str, c: u8, s: i64) -> i64 {
        let mut cx = x;
        for ch in t.chars() {
            if let Some(g) = glyph(ch) {
                for (row, bits) in g.iter().enumerate() {
                    for col in 0..5 {
                        if bits & (0x10 >> col) != 0 {
                            self.rect(
                                cx + col * s,
                                y + row as i64 * s,
                                cx + col * s + s - 1,
                                y + row as i64 * s + s - 1,
                                c,
                            );
                        }
                    }
                }
            }
            cx += 6 * s;
        }
        cx - x
    }
    pub fn text_width(t: &str, s: i64) -> i64 {
        t.chars().count() as i64 * 6 * s
    }

    /// The image as PNG bytes (colour type 3, 8 bits per pixel).
    pub fn png(&self) -> Vec<u8> {
        let mut raw = Vec::with_capacity((self.w + 1) * self.h);
        for y in 0..self.h {
            raw.push(0); // filter: none
            raw.extend_from_slice(&self.px[y * self.w..(y + 1) * self.w]);
        }
        let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
        let mut ihdr = Vec::new();
        ihdr.extend_from_slice(&(self.w as u32).to_be_bytes());
        ihdr.extend_from_slice(&(self.h as u32).to_be_bytes());
        ihdr.extend_from_slice(&[8, 3, 0, 0, 0]);
        chunk(&mut out, b"IHDR", &ihdr);
        chunk(&mut out, b"PLTE", &PALETTE.concat());
        chunk(&mut out, b"IDAT", &zlib(&raw, self.w + 1));
        chunk(&mut out, b"IEND", &[]);
        out
    }
}

fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    let mut h = crc32fast::Hasher::new();
    h.update(kind);
    h.update(data);
    out.extend_from_slice(&h.finalize().to_be_bytes());
}

struct Bits {
    out: Vec<u8>,
    acc: u64,
    n: u32,
}

impl Bits {
    fn put(&mut self, v: u32, n: u32) {
        self.acc |= u64::from(v) << self.n;
        self.n += n;
        while self.n >= 8 {
            self.out.push(self.acc as u8);
            self.acc >>= 8;
            self.n -= 8;
        }
    }
    /// A Huffman code: `n` bits, most significant first.
    fn code(&mut self, v: u32, n: u32) {
        let r = v.reverse_bits() >> (32 - n);
        self.put(r, n);
    }
    fn finish(mut self) -> Vec<u8> {
        if self.n > 0 {
            self.out.push(self.acc as u8);
        }
        self.out
    }
}

const LEN_BASE: [u32; 29] =
    [3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 15, 17, 19, 23, 27, 31, 35, 43, 51, 59, 67, 83, 99, 115, 131, 163, 195, 227, 258];
const LEN_EXTRA: [u32; 29] = [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0];
const DIST_BASE: [u32; 30] = [
    1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 49, 65, 97, 129, 193, 257, 385, 513, 769, 1025, 1537, 2049, 3073, 4097, 6145,
    8193, 12289, 16385, 24577,
];
const DIST_EXTRA: [u32; 30] =
    [0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13];

fn lit(b: &mut Bits, v: u32) {
    match v {
        0..=143 => b.code(0x30 + v, 8),
        144..=255 => b.code(0x190 + v - 144, 9),
        256..=279 => b.code(v - 256, 7),
        _ => b.code(0xc0 + v - 280, 8),
    }
}

/// zlib stream of one fixed-Huffman deflate block; matches at distance 1 and `row`.
pub fn zlib(data: &[u8], row: usize) -> Vec<u8> {
    let mut b = Bits { out: vec![0x78, 0x01], acc: 0, n: 0 };
    b.put(1, 1); // final block
    b.put(1, 2); // fixed Huffman
    let mut i = 0;
    while i < data.len() {
        let mut best = (0usize, 0usize);
        for d in [1, row] {
            if d == 0 || d > 32768 || i < d {
                continue;
            }
            let mut l = 0;
            while l < 258 && i + l < data.len() && data[i + l] == data[i + l - d] {
                l += 1;
            }
            if l > best.0 {
                best = (l, d);
            }
        }
        if best.0 >= 3 {
            let (l, d) = best;
            let li = LEN_BASE.iter().rposition(|&x| x as usize <= l).unwrap_or(0);
            lit(&mut b, 257 + li as u32);
            b.put(l as u32 - LEN_BASE[li], LEN_EXTRA[li]);
            let di = DIST_BASE.iter().rposition(|&x| x as usize <= d).unwrap_or(0);
            b.code(di as u32, 5);
            b.put(d as u32 - DIST_BASE[di], DIST_EXTRA[di]);
            i += l;
        } else {
            lit(&mut b, u32::from(data[i]));
            i += 1;
        }
    }
    lit(&mut b, 256);
    let mut out = b.finish();
    let (mut a, mut s) = (1u32, 0u32);
    for &x in data {
        a = (a + u32::from(x)) % 65521;
        s = (s + a) % 65521;
    }
    out.extend_from_slice(&((s << 16) | a).to_be_bytes());
    out
}

fn glyph(c: char) -> Option<[u8; 7]> {
    let c = c.to_ascii_lowercase();
    Some(match c {
        '0' => [0x0e, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0e],
        '1' => [0x04, 0x0c, 0x04, 0x04, 0x04, 0x04, 0x0e],
        '2' => [0x0e, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1f],
        '3' => [0x1f, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0e],
        '4' => [0x02, 0x06, 0x0a, 0x12, 0x1f, 0x02, 0x02],
        '5' => [0x1f, 0x10, 0x1e, 0x01, 0x01, 0x11, 0x0e],
        '6' => [0x06, 0x08, 0x10, 0x1e, 0x11, 0x11, 0x0e],
        '7' => [0x1f, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08],
        '8' => [0x0e, 0x11, 0x11, 0x0e, 0x11, 0x11, 0x0e],
        '9' => [0x0e, 0x11, 0x11, 0x0f, 0x01, 0x02, 0x0c],
        'a' => [0x00, 0x00, 0x0e, 0x01, 0x0f, 0x11, 0x0f],
        'b' => [0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x1e],
        'c' => [0x00, 0x00, 0x0e, 0x10, 0x10, 0x11, 0x0e],
        'd' => [0x01, 0x01, 0x0d, 0x13, 0x11, 0x11, 0x0f],
        'e' => [0x00, 0x00, 0x0e, 0x11, 0x1f, 0x10, 0x0e],
        'f' => [0x06, 0x09, 0x08, 0x1c, 0x08, 0x08, 0x08],
        'g' => [0x00, 0x0f, 0x11, 0x11, 0x0f, 0x01, 0x0e],
        'h' => [0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x11],
        'i' => [0x04, 0x00, 0x0c, 0x04, 0x04, 0x04, 0x0e],
        'j' => [0x02, 0x00, 0x06, 0x02, 0x02, 0x12, 0x0c],
        'k' => [0x10, 0x10, 0x12, 0x14, 0x18, 0x14, 0x12],
        'l' => [0x0c, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0e],
        'm' => [0x00, 0x00, 0x1a, 0x15, 0x15, 0x11, 0x11],
        'n' => [0x00, 0x00, 0x16, 0x19, 0x11, 0x11, 0x11],
        'o' => [0x00, 0x00, 0x0e, 0x11, 0x11, 0x11, 0x0e],
        'p' => [0x00, 0x00, 0x1e, 0x11, 0x1e, 0x10, 0x10],
        'q' => [0x00, 0x00, 0x0d, 0x13, 0x0f, 0x01, 0x01],
        'r' => [0x00, 0x00, 0x16, 0x19, 0x10, 0x10, 0x10],
        's' => [0x00, 0x00, 0x0e, 0x10, 0x0e, 0x01, 0x1e],
        't' => [0x08, 0x08, 0x1c, 0x08, 0x08, 0x09, 0x06],
        'u' => [0x00, 0x00, 0x11, 0x11, 0x11, 0x13, 0x0d],
        'v' => [0x00, 0x00, 0x11, 0x11, 0x11, 0x0a, 0x04],
        'w' => [0x00, 0x00, 0x11, 0x11, 0x15, 0x15, 0x0a],
        'x' => [0x00, 0x00, 0x11, 0x0a, 0x04, 0x0a, 0x11],
        'y' => [0x00, 0x00, 0x11, 0x11, 0x0f, 0x01, 0x0e],
        'z' => [0x00, 0x00, 0x1f, 0x02, 0x04, 0x08, 0x1f],
        '.' => [0x00, 0x00, 0x00, 0x00, 0x00, 0x0c, 0x0c],
        ',' => [0x00, 0x00, 0x00, 0x00, 0x0c, 0x04, 0x08],
        '%' => [0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03],
        '+' => [0x00, 0x04, 0x04, 0x1f, 0x04, 0x04, 0x00],
        '-' => [0x00, 0x00, 0x00, 0x1f, 0x00, 0x00, 0x00],
        ':' => [0x00, 0x0c, 0x0c, 0x00, 0x0c, 0x0c, 0x00],
        '(' => [0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02],
        ')' => [0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08],
        '/' => [0x00, 0x01, 0x02, 0x04, 0x08, 0x10, 0x00],
        '=' => [0x00, 0x00, 0x1f, 0x00, 0x1f, 0x00, 0x00],
        ' ' => [0; 7],
        _ => return None,
    })
}

fn series_label(r: &RunResult) -> String {
    r.label()
}

/// Draws WAF (y) against utilisation (x), one line per policy and trim setting; trim lines
/// are solid, the others dashed.
pub fn render(results: &[RunResult], title: &str) -> Canvas {
    let (w, h) = (960usize, 600usize);
    let mut c = Canvas::new(w, h);
    let (left, right, top, bottom) = (90i64, 300i64, 60i64, 80i64);
    let (pw, ph) = (w as i64 - left - right, h as i64 - top - bottom);
    let mut xs: Vec<f64> = results.iter().map(|r| r.utilization * 100.0).collect();
    xs.sort_by(|a, b| a.total_cmp(b));
    xs.dedup();
    let (xmin, xmax) = (xs.first().copied().unwrap_or(0.0).min(50.0), 100.0);
    let ymaxv = results.iter().map(|r| r.waf).filter(|v| v.is_finite()).fold(1.0f64, f64::max);
    let ystep = if ymaxv <= 2.0 {
        0.2
    } else if ymaxv <= 4.0 {
        0.5
    } else {
        1.0
    };
    let ymax = ((ymaxv / ystep).ceil() * ystep).max(1.0 + ystep);
    let ymin = 1.0;
    let px = |x: f64| left + ((x - xmin) / (xmax - xmin).max(1e-9) * pw as f64).round() as i64;
    let py = |y: f64| top + ph - ((y - ymin) / (ymax - ymin) * ph as f64).round() as i64;
    // Grid and axes.
    let mut y = ymin;
    while y <= ymax + 1e-9 {
        c.line(left, py(y), left + pw, py(y), 2, 1, 0);
        let t = format!("{y:.1}");
        c.text(left - 12 - Canvas::text_width(&t, 2), py(y) - 7, &t, 1, 2);
        y += ystep;
    }
    for &x in &xs {
        c.line(px(x), top, px(x), top + ph, 2, 1, 0);
        let t = format!("{x:.0}%");
        c.text(px(x) - Canvas::text_width(&t, 2) / 2, top + ph + 12, &t, 1, 2);
    }
    c.line(left, top, left, top + ph, 1, 2, 0);
    c.line(left, top + ph, left + pw, top + ph, 1, 2, 0);
    c.text(left + pw / 2 - Canvas::text_width("utilisation", 2) / 2, top + ph + 44, "utilisation", 1, 2);
    c.text(16, top - 40, "waf", 1, 2);
    c.text(left, 16, title, 1, 2);
    // Series.
    let mut labels: Vec<String> = Vec::new();
    for r in results {
        let l = series_label(r);
        if !labels.contains(&l) {
            labels.push(l);
        }
    }
    let mut policies: Vec<String> = Vec::new();
    for r in results {
        if !policies.contains(&r.policy) {
            policies.push(r.policy.clone());
        }
    }
    for (i, l) in labels.iter().enumerate() {
        let mut pts: Vec<(f64, f64)> = results
            .iter()
            .filter(|r| &series_label(r) == l && r.waf.is_finite())
            .map(|r| (r.utilization * 100.0, r.waf))
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        let Some(r0) = results.iter().find(|r| &series_label(r) == l) else { continue };
        let color = 4 + (policies.iter().position(|p| p == &r0.policy).unwrap_or(0) % 8) as u8;
        let dash = if r0.trim { 0 } else { 6 };
        for p in pts.windows(2) {
            c.line(px(p[0].0), py(p[0].1.min(ymax)), px(p[1].0), py(p[1].1.min(ymax)), color, 3, dash);
        }
        for &(x, y) in &pts {
            let (cx, cy) = (px(x), py(y.min(ymax)));
            if r0.trim {
                c.rect(cx - 4, cy - 4, cx + 4, cy + 4, color);
            } else {
                c.rect(cx - 4, cy - 4, cx + 4, cy + 4, color);
                c.rect(cx - 2, cy - 2, cx + 2, cy + 2, 0);
            }
        }
        // Legend.
        let ly = top + 10 + i as i64 * 28;
        let lx = left + pw + 24;
        c.line(lx, ly + 7, lx + 40, ly + 7, color, 3, dash);
        c.text(lx + 52, ly, l, 1, 2);
    }
    c
}

/// Whether a PNG can be written at `path`, asked before the runs it would draw take their
/// time: nothing is left behind where no file was.
pub fn check_writable(path: &Path) -> Result<(), String> {
    let existed = path.exists();
    std::fs::OpenOptions::new().append(true).create(true).open(path).map_err(|e| format!("--plot: cannot write {}: {e}", path.display()))?;
    if !existed {
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}

/// Writes the WAF-vs-utilisation plot of `results` to `path`.
pub fn waf_vs_utilization(results: &[RunResult], path: &Path) -> Result<(), String> {
    let title = results.first().map_or(String::new(), |r| format!("{}: steady-state waf", r.workload));
    let png = render(results, &title).png();
    std::fs::write(path, png).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Inflates a zlib stream with fixed-Huffman blocks (the subset `zlib` writes).
    fn inflate(z: &[u8]) -> Vec<u8> {
        struct R<'a> {
            d: &'a [u8],
            pos: usize,
        }
        impl R<'_> {
            fn bit(&mut self) -> u32 {
                let b = (self.d[self.pos / 8] >> (self.pos % 8)) & 1;
                self.pos += 1;
                u32::from(b)
            }
            fn bits(&mut self, n: u32) -> u32 {
                (0..n).map(|i| self.bit() << i).sum()
            }
            fn huff(&mut self, n: u32) -> u32 {
                (0..n).fold(0, |a, _| (a << 1) | self.bit())
            }
        }
        let mut r = R { d: &z[2..], pos: 0 };
        assert_eq!(r.bits(3), 0b011);
        let mut out: Vec<u8> = Vec::new();
        loop {
            let mut v = r.huff(7);
            let sym = if v <= 0x17 {
                v + 256
            } else {
                v = (v << 1) | r.bit();
                if (0x30..=0xbf).contains(&v) {
                    v - 0x30
                } else if (0xc0..=0xc7).contains(&v) {
                    v - 0xc0 + 280
                } else {
                    v = (v << 1) | r.bit();
                    v - 0x190 + 144
                }
            };
            match sym {
                0..=255 => out.push(sym as u8),
                256 => break,
                _ => {
                    let li = (sym - 257) as usize;
                    let len = LEN_BASE[li] + r.bits(LEN_EXTRA[li]);
                    let di = r.huff(5) as usize;
                    let dist = DIST_BASE[di] + r.bits(DIST_EXTRA[di]);
                    for _ in 0..len {
                        let b = out[out.len() - dist as usize];
                        out.push(b);
                    }
                }
            }
        }
        out
    }

    #[test]
    fn deflate_round_trips() {
        let mut data = Vec::new();
        for y in 0..50u32 {
            data.push(0);
            for x in 0..300u32 {
                data.push(if (x / 7 + y / 3) % 5 == 0 { (x % 251) as u8 } else { 3 });
            }
        }
        let z = zlib(&data, 301);
        assert!(z.len() < data.len() / 4, "{} of {}", z.len(), data.len());
        assert_eq!(inflate(&z[..z.len() - 4]), data);
        let (mut a, mut s) = (1u32, 0u32);
        for &x in &data {
            a = (a + u32::from(x)) % 65521;
            s = (s + a) % 65521;
        }
        assert_eq!(&z[z.len() - 4..], &((s << 16) | a).to_be_bytes());
    }

    #[test]
    fn png_has_valid_chunks() {
        let mut c = Canvas::new(40, 20);
        c.text(1, 1, "waf 1.0", 1, 1);
        c.line(0, 19, 39, 0, 4, 2, 3);
        let png = c.png();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        let mut pos = 8;
        let mut kinds = Vec::new();
        while pos < png.len() {
            let len = u32::from_be_bytes(png[pos..pos + 4].try_into().unwrap()) as usize;
            let kind = &png[pos + 4..pos + 8];
            let crc = crc32fast::hash(&png[pos + 4..pos + 8 + len]);
            assert_eq!(crc.to_be_bytes(), png[pos + 8 + len..pos + 12 + len]);
            kinds.push(String::from_utf8_lossy(kind).to_string());
            if kind == b"IDAT" {
                let raw = inflate(&png[pos + 8..pos + 8 + len - 4]);
                assert_eq!(raw.len(), 41 * 20);
                assert_eq!(raw[41 + 1 + 1], c.get(1, 1));
            }
            pos += 12 + len;
        }
        assert_eq!(kinds, ["IHDR", "PLTE", "IDAT", "IEND"]);
    }
}
