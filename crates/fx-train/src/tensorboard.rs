//! TensorBoard event files of scalars and HParams summaries, so that `tensorboard --logdir
//! sweeps/NAME/tensorboard` draws a sweep's trials side by side and tabulates them.
//!
//! An event file is TFRecord framing (`u64` length, masked CRC-32C of the length, the
//! bytes, masked CRC-32C of the bytes; little-endian) around `tensorflow.Event` protobufs:
//! `wall_time` (field 1, double), `step` (2, int64), `file_version` (3, string: the first
//! event says `brain.Event:2`) and `summary` (5) holding `Summary.Value`s of `tag` (1) and
//! `simple_value` (2, float). Those few fields are encoded here by hand, and CRC-32C
//! (Castagnoli) with them: no protobuf or CRC-32C crate is in this workspace's registry.
//!
//! The HParams dashboard's summaries too ([`write_experiment`], [`Session`]): a value of
//! `tag`, `metadata` (9: `SummaryMetadata.plugin_data` = plugin `hparams` and a serialized
//! `HParamsPluginData`) and `tensor` (8: the plugin's null tensor, an empty float vector);
//! the experiment (its hyperparameters and metrics) in the log folder's root, each trial's
//! `SessionStartInfo` (its hyperparameter values) and `SessionEndInfo` (success or failure)
//! in its run, as TensorBoard's `hparams` summary API writes them.

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

/// A hyperparameter's value as the HParams dashboard shows it.
#[derive(Debug, Clone, PartialEq)]
pub enum HParam {
    Number(f64),
    Text(String),
    Bool(bool),
}

/// A trial as an HParams session: its hyperparameters and whether it ended well.
#[derive(Debug, Clone, PartialEq)]
pub struct Session {
    pub hparams: Vec<(String, HParam)>,
    pub success: bool,
}

/// Writes `dir/EVENT_FILE` (atomically) with the file-version event, the HParams session's
/// start and end when `session` is given, and one event per scalar, stamped `wall_time`.
/// Non-finite values are left out (TensorBoard draws them as gaps anyway, and a NaN would
/// read as a number in other tools).
pub fn write_scalars(dir: &Path, scalars: &[Scalar], session: Option<&Session>, wall_time: f64) -> Result<()> {
    let mut out = Vec::new();
    out.extend(record(&event(wall_time, 0, Some("brain.Event:2"), None)));
    if let Some(s) = session {
        let mut start = Vec::new();
        for (name, v) in &s.hparams {
            let mut entry = Vec::new();
            bytes_field(&mut entry, 1, name.as_bytes());
            bytes_field(&mut entry, 2, &value(v));
            bytes_field(&mut start, 1, &entry);
        }
        key(&mut start, 5, 1);
        start.extend(wall_time.to_le_bytes());
        out.extend(record(&plugin_event(wall_time, "_hparams_/session_start_info", 3, &start)));
        let mut end = Vec::new();
        key(&mut end, 1, 0);
        varint(&mut end, if s.success { 1 } else { 2 });
        key(&mut end, 2, 1);
        end.extend(wall_time.to_le_bytes());
        out.extend(record(&plugin_event(wall_time, "_hparams_/session_end_info", 4, &end)));
    }
    for s in scalars.iter().filter(|s| s.value.is_finite()) {
        out.extend(record(&event(wall_time, s.step, None, Some((&s.tag, s.value as f32)))));
    }
    std::fs::create_dir_all(dir)?;
    crate::run_dir::write_atomic(&dir.join(EVENT_FILE), &out)
}

/// Writes `dir/EVENT_FILE` (the log folder's root) with the HParams experiment: each
/// hyperparameter's name and type (from a session's values) and the metrics, scalar tags
/// of the sessions' runs.
pub fn write_experiment(dir: &Path, hparams: &[(String, HParam)], metrics: &[&str], wall_time: f64) -> Result<()> {
    let mut exp = Vec::new();
    key(&mut exp, 3, 1);
    exp.extend(wall_time.to_le_bytes());
    for (name, v) in hparams {
        let mut info = Vec::new();
        bytes_field(&mut info, 1, name.as_bytes());
        // DataType: STRING 1, BOOL 2, FLOAT64 3.
        key(&mut info, 4, 0);
        varint(
            &mut info,
            match v {
                HParam::Text(_) => 1,
                HParam::Bool(_) => 2,
                HParam::Number(_) => 3,
            },
        );
        bytes_field(&mut exp, 4, &info);
    }
    for m in metrics {
        let mut name = Vec::new();
        bytes_field(&mut name, 2, m.as_bytes());
        let mut info = Vec::new();
        bytes_field(&mut info, 1, &name);
        bytes_field(&mut exp, 5, &info);
    }
    let mut out = Vec::new();
    out.extend(record(&event(wall_time, 0, Some("brain.Event:2"), None)));
    out.extend(record(&plugin_event(wall_time, "_hparams_/experiment", 2, &exp)));
    std::fs::create_dir_all(dir)?;
    crate::run_dir::write_atomic(&dir.join(EVENT_FILE), &out)
}

/// A `google.protobuf.Value`: number (2), string (3) or bool (4).
fn value(v: &HParam) -> Vec<u8> {
    let mut out = Vec::new();
    match v {
        HParam::Number(x) => {
            key(&mut out, 2, 1);
            out.extend(x.to_le_bytes());
        }
        HParam::Text(t) => bytes_field(&mut out, 3, t.as_bytes()),
        HParam::Bool(b) => {
            key(&mut out, 4, 0);
            varint(&mut out, u64::from(*b));
        }
    }
    out
}

/// An event of one HParams summary: `HParamsPluginData` (version 0) holding `data` as its
/// oneof field `field` (experiment 2, session start 3, session end 4).
fn plugin_event(wall_time: f64, tag: &str, field: u32, data: &[u8]) -> Vec<u8> {
    let mut content = Vec::new();
    bytes_field(&mut content, field, data);
    let mut plugin = Vec::new();
    bytes_field(&mut plugin, 1, b"hparams");
    bytes_field(&mut plugin, 2, &content);
    let mut metadata = Vec::new();
    bytes_field(&mut metadata, 1, &plugin);
    let mut val = Vec::new();
    bytes_field(&mut val, 1, tag.as_bytes());
    // The plugin's null tensor: DT_FLOAT, shape [0].
    bytes_field(&mut val, 8, &[0x08, 0x01, 0x12, 0x02, 0x12, 0x00]);
    bytes_field(&mut val, 9, &metadata);
    let mut summary = Vec::new();
    bytes_field(&mut summary, 1, &val);
    let mut e = Vec::new();
    key(&mut e, 1, 1);
    e.extend(wall_time.to_le_bytes());
    bytes_field(&mut e, 5, &summary);
    e
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
    /// A decoded event: wall time, step, file version, scalar (tag, value), plugin summary
    /// (tag, plugin name, content).
    type Decoded = (f64, i64, Option<String>, Option<(String, f32)>, Option<(String, String, Vec<u8>)>);

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

    /// A message's fields: (number, bytes of a length-delimited or fixed field, varint).
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
        let (mut i, mut events) = (0, Vec::new());
        while i < bytes.len() {
            let len_bytes = &bytes[i..i + 8];
            let n = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
            assert_eq!(u32::from_le_bytes(bytes[i + 8..i + 12].try_into().unwrap()), crc(len_bytes));
            let data = &bytes[i + 12..i + 12 + n];
            assert_eq!(u32::from_le_bytes(bytes[i + 12 + n..i + 16 + n].try_into().unwrap()), crc(data));
            i += 16 + n;
            let (mut wall, mut step, mut version, mut scalar, mut plugin) = (0.0, 0, None, None, None);
            for (f, b, v) in fields(data) {
                match f {
                    1 => wall = f64::from_le_bytes(b.try_into().unwrap()),
                    2 => step = v as i64,
                    3 => version = Some(String::from_utf8(b).unwrap()),
                    5 => {
                        for (vf, vb, _) in fields(&b) {
                            assert_eq!(vf, 1, "Summary.value");
                            let (mut tag, mut value, mut meta) = (String::new(), None, None);
                            for (sf, sb, _) in fields(&vb) {
                                match sf {
                                    1 => tag = String::from_utf8(sb).unwrap(),
                                    2 => value = Some(f32::from_le_bytes(sb.try_into().unwrap())),
                                    // TensorProto: DT_FLOAT (1), shape (2) of one dim of size 0.
                                    8 => {
                                        let t = fields(&sb);
                                        assert_eq!((t[0].0, t[0].2, t[1].0), (1, 1, 2), "the null tensor");
                                        assert_eq!(fields(&t[1].1), vec![(2, Vec::new(), 0)]);
                                    }
                                    9 => {
                                        // SummaryMetadata.plugin_data: plugin_name, content.
                                        let pd = fields(&fields(&sb)[0].1);
                                        meta = Some((String::from_utf8(pd[0].1.clone()).unwrap(), pd[1].1.clone()));
                                    }
                                    other => panic!("Summary.Value field {other}"),
                                }
                            }
                            match (value, meta) {
                                (Some(v), None) => scalar = Some((tag, v)),
                                (None, Some((name, content))) => plugin = Some((tag, name, content)),
                                _ => panic!("a value is a scalar or a plugin summary"),
                            }
                        }
                    }
                    other => panic!("Event field {other}"),
                }
            }
            events.push((wall, step, version, scalar, plugin));
        }
        events
    }

    #[test]
    fn event_files_hold_the_version_then_the_scalars() {
        let dir = tempfile::tempdir().unwrap();
        let s = |tag: &str, step, value| Scalar { tag: tag.into(), step, value };
        let scalars =
            [s("val/loss", 1, 0.75), s("val/loss", 2, 0.5), s("val/sharpe", 300, -1.25), s("skipped", 3, f64::NAN)];
        write_scalars(dir.path(), &scalars, None, 1.7e9).unwrap();
        let ev = read(&std::fs::read(dir.path().join(EVENT_FILE)).unwrap());
        assert_eq!(ev.len(), 4, "the version event and the three finite scalars");
        assert_eq!(ev[0], (1.7e9, 0, Some("brain.Event:2".into()), None, None));
        assert_eq!(ev[1], (1.7e9, 1, None, Some(("val/loss".into(), 0.75)), None));
        assert_eq!(ev[2], (1.7e9, 2, None, Some(("val/loss".into(), 0.5)), None));
        assert_eq!(ev[3], (1.7e9, 300, None, Some(("val/sharpe".into(), -1.25)), None));
        // Written again: replaced, not appended.
        write_scalars(dir.path(), &scalars[..1], None, 1.0).unwrap();
        assert_eq!(read(&std::fs::read(dir.path().join(EVENT_FILE)).unwrap()).len(), 2);
    }

    /// The HParams summaries, decoded from the plugin's protos (`HParamsPluginData`:
    /// experiment 2, session_start_info 3, session_end_info 4): the experiment's
    /// hyperparameters with their types and its metrics; a session's values (number, string,
    /// bool as `google.protobuf.Value` 2, 3, 4), start time, status (SUCCESS 1, FAILURE 2).
    #[test]
    fn hparams_summaries_hold_the_experiment_and_each_session() {
        let dir = tempfile::tempdir().unwrap();
        let hp = vec![
            ("dqn.optimizer.lr".to_string(), HParam::Number(3e-4)),
            ("sampler".to_string(), HParam::Text("sobol".into())),
            ("dueling".to_string(), HParam::Bool(true)),
        ];
        write_experiment(dir.path(), &hp, &["val/sharpe", "val/loss"], 5.0).unwrap();
        let ev = read(&std::fs::read(dir.path().join(EVENT_FILE)).unwrap());
        assert_eq!(ev.len(), 2);
        let (tag, name, content) = ev[1].4.clone().unwrap();
        assert_eq!((tag.as_str(), name.as_str()), ("_hparams_/experiment", "hparams"));
        let data = fields(&content);
        assert_eq!(data.len(), 1, "version 0 is the default, left out");
        assert_eq!(data[0].0, 2);
        let exp = fields(&data[0].1);
        assert_eq!((exp[0].0, f64::from_le_bytes(exp[0].1.clone().try_into().unwrap())), (3, 5.0));
        let infos: Vec<(String, u64)> = exp
            .iter()
            .filter(|f| f.0 == 4)
            .map(|f| {
                let i = fields(&f.1);
                (String::from_utf8(i[0].1.clone()).unwrap(), i[1].2)
            })
            .collect();
        assert_eq!(infos, vec![("dqn.optimizer.lr".into(), 3), ("sampler".into(), 1), ("dueling".into(), 2)]);
        let metrics: Vec<String> = exp
            .iter()
            .filter(|f| f.0 == 5)
            .map(|f| String::from_utf8(fields(&fields(&f.1)[0].1)[0].1.clone()).unwrap())
            .collect();
        assert_eq!(metrics, ["val/sharpe", "val/loss"]);

        let run = dir.path().join("trial-0");
        let session = Session { hparams: hp.clone(), success: false };
        write_scalars(&run, &[Scalar { tag: "val/sharpe".into(), step: 9, value: 0.5 }], Some(&session), 7.0).unwrap();
        let ev = read(&std::fs::read(run.join(EVENT_FILE)).unwrap());
        assert_eq!(ev.len(), 4, "version, session start, session end, the scalar");
        let (tag, _, content) = ev[1].4.clone().unwrap();
        assert_eq!(tag, "_hparams_/session_start_info");
        let start = fields(&fields(&content)[0].1);
        let mut values = Vec::new();
        for (f, b, _) in &start {
            if *f == 1 {
                let entry = fields(b);
                let v = fields(&entry[1].1);
                let decoded = match v[0].0 {
                    2 => HParam::Number(f64::from_le_bytes(v[0].1.clone().try_into().unwrap())),
                    3 => HParam::Text(String::from_utf8(v[0].1.clone()).unwrap()),
                    4 => HParam::Bool(v[0].2 == 1),
                    other => panic!("Value field {other}"),
                };
                values.push((String::from_utf8(entry[0].1.clone()).unwrap(), decoded));
            } else {
                assert_eq!((*f, f64::from_le_bytes(b.clone().try_into().unwrap())), (5, 7.0), "start_time_secs");
            }
        }
        assert_eq!(values, hp);
        let (tag, _, content) = ev[2].4.clone().unwrap();
        assert_eq!(tag, "_hparams_/session_end_info");
        let data = fields(&content);
        assert_eq!(data[0].0, 4);
        let end = fields(&data[0].1);
        assert_eq!((end[0].0, end[0].2), (1, 2), "STATUS_FAILURE");
        assert_eq!(ev[3].3, Some(("val/sharpe".into(), 0.5)));
    }
}
