//! TensorBoard event files of scalars, so that `tensorboard --logdir sweeps/NAME` draws a
//! sweep's trials side by side.
//!
//! An event file is TFRecord framing (`u64` length, masked CRC-32C of the length, the
//! bytes, masked CRC-32C of the bytes; little-endian) around `tensorflow.Event` protobufs:
//! `wall_time` (field 1, double), `step` (2, int64), `file_version` (3, string: the first
//! event says `brain.Event:2`) and `summary` (5) holding `Summary.Value`s of `tag` (1) and
//! `simple_value` (2, float). Those few fields are encoded here by hand, and CRC-32C
//! (Castagnoli) with them: no protobuf or CRC-32C crate is in this workspace's registry.
//! The HParams plugin's summaries are not written.

use std::path::Path;

use anyhow::Result;

/// The name of the one event file of a folder (TensorBoard reads `events.out.tfevents*`;
/// a fixed name lets a sweep that finishes again replace it rather than add a second).
pub const EVENT_FILE: &str = "events.out.tfevents.0.fx-train";

/// One scalar point: tag, step, value.
#[derive(Debug, Clone, PartialEq)]
pub struct Scalar {
    pub tag: String,
    pub step: i64,
    pub value: f64,
}

/// Writes `dir/EVENT_FILE` (atomically) with the file-version event and one event per
/// scalar, stamped `wall_time`. Non-finite values are left out (TensorBoard draws them
/// as gaps anyway, and a NaN would read as a number in other tools).
pub fn write_scalars(dir: &Path, scalars: &[Scalar], wall_time: f64) -> Result<()> {
    let mut out = Vec::new();
    out.extend(record(&event(wall_time, 0, Some("brain.Event:2"), None)));
    for s in scalars.iter().filter(|s| s.value.is_finite()) {
        out.extend(record(&event(wall_time, s.step, None, Some((&s.tag, s.value as f32)))));
    }
    std::fs::create_dir_all(dir)?;
    crate::run_dir::write_atomic(&dir.join(EVENT_FILE), &out)
}

/// A `tensorflow.Event`: wall time, step, and either the file version or one scalar.
fn event(wall_time: f64, step: i64, version: Option<&str>, scalar: Option<(&str, f32)>) -> Vec<u8> {
    let mut e = Vec::new();
    key(&mut e, 1, 1);
    e.extend(wall_time.to_le_bytes());
    if step != 0 {
        key(&mut e, 2, 0);
        varint(&mut e, step as u64);
    }
    if let Some(v) = version {
        bytes_field(&mut e, 3, v.as_bytes());
    }
    if let Some((tag, value)) = scalar {
        let mut val = Vec::new();
        bytes_field(&mut val, 1, tag.as_bytes());
        key(&mut val, 2, 5);
        val.extend(value.to_le_bytes());
        let mut summary = Vec::new();
        bytes_field(&mut summary, 1, &val);
        bytes_field(&mut e, 5, &summary);
    }
    e
}

fn key(out: &mut Vec<u8>, field: u32, wire: u8) {
    varint(out, u64::from(field) << 3 | u64::from(wire));
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn bytes_field(out: &mut Vec<u8>, field: u32, b: &[u8]) {
    key(out, field, 2);
    varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

/// One TFRecord: length, its masked CRC, the data, its masked CRC.
fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut r = Vec::with_capacity(data.len() + 16);
    r.extend(len);
    r.extend(masked_crc(&len).to_le_bytes());
    r.extend_from_slice(data);
    r.extend(masked_crc(data).to_le_bytes());
    r
}

/// TFRecord's masked CRC-32C.
fn masked_crc(b: &[u8]) -> u32 {
    let c = crc32c(b);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), bitwise: event files are small.
fn crc32c(b: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in b {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0x82F6_3B78 } else { crc >> 1 };
        }
    }
    !crc
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The standard check value and RFC 3720's (iSCSI) test vectors.
    #[test]
    fn crc32c_matches_the_published_vectors() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xFFu8; 32]), 0x62A8_AB43);
        let inc: Vec<u8> = (0u8..32).collect();
        assert_eq!(crc32c(&inc), 0x46DD_794E);
    }

    /// A reader written from the format's spec (not from the writer above): frames checked
    /// by their CRCs, then the protobuf fields decoded.
    /// A decoded event: wall time, step, file version, scalar (tag, value).
    type Decoded = (f64, i64, Option<String>, Option<(String, f32)>);

    fn read(bytes: &[u8]) -> Vec<Decoded> {
        fn crc(b: &[u8]) -> u32 {
            // Table-driven, unlike the writer's bitwise loop.
            let table: Vec<u32> = (0..256u32)
                .map(|i| (0..8).fold(i, |c, _| if c & 1 == 1 { 0x82F6_3B78 ^ (c >> 1) } else { c >> 1 }))
                .collect();
            let c = b.iter().fold(0xFFFF_FFFFu32, |c, &x| table[((c ^ u32::from(x)) & 0xFF) as usize] ^ (c >> 8));
            let c = !c;
            // The mask: rotate right by 15, add a constant (as the TFRecord spec states it).
            c.rotate_right(15).wrapping_add(0xa282_ead8)
        }
        fn varint(b: &[u8], i: &mut usize) -> u64 {
            let (mut v, mut shift) = (0u64, 0);
            loop {
                let x = b[*i];
                *i += 1;
                v |= u64::from(x & 0x7f) << shift;
                if x < 0x80 {
                    return v;
                }
                shift += 7;
            }
        }
        fn fields(b: &[u8]) -> Vec<(u64, Vec<u8>, u64)> {
            let (mut i, mut out) = (0, Vec::new());
            while i < b.len() {
                let k = varint(b, &mut i);
                let (field, wire) = (k >> 3, k & 7);
                match wire {
                    0 => out.push((field, Vec::new(), varint(b, &mut i))),
                    1 => {
                        out.push((field, b[i..i + 8].to_vec(), 0));
                        i += 8;
                    }
                    2 => {
                        let n = varint(b, &mut i) as usize;
                        out.push((field, b[i..i + n].to_vec(), 0));
                        i += n;
                    }
                    5 => {
                        out.push((field, b[i..i + 4].to_vec(), 0));
                        i += 4;
                    }
                    w => panic!("wire type {w}"),
                }
            }
            out
        }
        let (mut i, mut events) = (0, Vec::new());
        while i < bytes.len() {
            let len_bytes = &bytes[i..i + 8];
            let n = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
            assert_eq!(u32::from_le_bytes(bytes[i + 8..i + 12].try_into().unwrap()), crc(len_bytes));
            let data = &bytes[i + 12..i + 12 + n];
            assert_eq!(u32::from_le_bytes(bytes[i + 12 + n..i + 16 + n].try_into().unwrap()), crc(data));
            i += 16 + n;
            let (mut wall, mut step, mut version, mut scalar) = (0.0, 0, None, None);
            for (f, b, v) in fields(data) {
                match f {
                    1 => wall = f64::from_le_bytes(b.try_into().unwrap()),
                    2 => step = v as i64,
                    3 => version = Some(String::from_utf8(b).unwrap()),
                    5 => {
                        for (vf, vb, _) in fields(&b) {
                            assert_eq!(vf, 1, "Summary.value");
                            let (mut tag, mut value) = (String::new(), f32::NAN);
                            for (sf, sb, _) in fields(&vb) {
                                match sf {
                                    1 => tag = String::from_utf8(sb).unwrap(),
                                    2 => value = f32::from_le_bytes(sb.try_into().unwrap()),
                                    other => panic!("Summary.Value field {other}"),
                                }
                            }
                            scalar = Some((tag, value));
                        }
                    }
                    other => panic!("Event field {other}"),
                }
            }
            events.push((wall, step, version, scalar));
        }
        events
    }

    #[test]
    fn event_files_hold_the_version_then_the_scalars() {
        let dir = tempfile::tempdir().unwrap();
        let s = |tag: &str, step, value| Scalar { tag: tag.into(), step, value };
        let scalars =
            [s("val/loss", 1, 0.75), s("val/loss", 2, 0.5), s("val/sharpe", 300, -1.25), s("skipped", 3, f64::NAN)];
        write_scalars(dir.path(), &scalars, 1.7e9).unwrap();
        let ev = read(&std::fs::read(dir.path().join(EVENT_FILE)).unwrap());
        assert_eq!(ev.len(), 4, "the version event and the three finite scalars");
        assert_eq!(ev[0], (1.7e9, 0, Some("brain.Event:2".into()), None));
        assert_eq!(ev[1], (1.7e9, 1, None, Some(("val/loss".into(), 0.75))));
        assert_eq!(ev[2], (1.7e9, 2, None, Some(("val/loss".into(), 0.5))));
        assert_eq!(ev[3], (1.7e9, 300, None, Some(("val/sharpe".into(), -1.25))));
        // Written again: replaced, not appended.
        write_scalars(dir.path(), &scalars[..1], 1.0).unwrap();
        assert_eq!(read(&std::fs::read(dir.path().join(EVENT_FILE)).unwrap()).len(), 2);
    }
}
