//! Checksums of what parquet's and arrow's own writers write, so that a byte changed on disk is found by readers.
//!
//! **Parquet.** Every page we write carries the CRC-32 of its bytes in its header, as the Parquet format specifies:
//! our own pages ([`pages`](super::pages), [`constants`](super::constants)) write it themselves. parquet's writer
//! (version 60) writes none, and has no setting to, so the pages of its column writers are given theirs here: a
//! metadata column encoded by an Arrow column writer leaves its pages in a [`PageBlobs`] store (header and page, one
//! blob each), and [`PageBlobs::take_chunk`] inserts the CRC field into each header and moves the chunk's offsets
//! by the bytes added; the activation column, when parquet's generic column writer encodes it (codecs other than
//! zstd, or properties of the user's own), goes through a [`ChunkPageWriter`] that writes the headers itself.
//!
//! **Arrow IPC.** The format has no checksums. [`BatchCrcs`] sits under the IPC file writer and takes the CRC-32 of
//! the file's bytes up to the end of each record batch (from the end of the one before, or the file's start); the
//! list goes into the footer's metadata under [`keys::BATCH_CRC32`](crate::dataset::keys::BATCH_CRC32). The rest of
//! the file — the end-of-stream marker, the footer, its length and the magic — is held back as the writer writes it,
//! and sealed with the CRC-32 of those bytes under [`keys::FOOTER_CRC32`](crate::dataset::keys::FOOTER_CRC32)
//! (taken with that value as [`FOOTER_CRC_PLACEHOLDER`]; [`check_ipc_footer`] checks it): every byte of the file is
//! covered.

use std::io::Write;
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use parquet::column::page::{CompressedPage, Page, PageWriteSpec, PageWriter};
use parquet::column::page_store::{PageKey, PageStore, PageStoreArgs, PageStoreFactory};
use parquet::column::writer::ColumnCloseResult;
use parquet::errors::{ParquetError, Result};

use crate::writing::output::Buffer;
use crate::writing::pages::{page_header, uleb128, PageKind};

/// The page blobs of the current row group's Arrow column writers, by column: a [`PageStoreFactory`] for
/// `ArrowWriterOptions::with_page_store_factory` whose stores keep their blobs here, where the sink takes them back.
#[derive(Debug, Clone, Default)]
pub(crate) struct PageBlobs(Arc<Mutex<Vec<Vec<Bytes>>>>);

/// One column chunk's store in a [`PageBlobs`].
struct ColumnBlobs {
    all: PageBlobs,
    column: usize,
}

impl PageStoreFactory for PageBlobs {
    fn create(&self, args: &PageStoreArgs<'_>) -> Result<Box<dyn PageStore>> {
        let column = args.column_index();
        let mut all = self.0.lock();
        if all.len() <= column {
            all.resize_with(column + 1, Vec::new);
        }
        all[column].clear(); // a new chunk of this column: the previous one was taken
        Ok(Box::new(ColumnBlobs { all: self.clone(), column }))
    }
}

impl PageStore for ColumnBlobs {
    fn put(&mut self, value: Bytes) -> Result<PageKey> {
        let mut all = self.all.0.lock();
        let blobs = &mut all[self.column];
        blobs.push(value);
        Ok(PageKey::new(blobs.len() as u64 - 1))
    }

    fn take(&mut self, key: PageKey) -> Result<Bytes> {
        let mut all = self.all.0.lock();
        all[self.column]
            .get_mut(key.get() as usize)
            .map(std::mem::take)
            .ok_or_else(|| ParquetError::General(format!("no page blob {} in column {}", key.get(), self.column)))
    }

    fn memory_size(&self) -> usize {
        self.all.0.lock()[self.column].iter().map(Bytes::len).sum()
    }
}

impl PageBlobs {
    /// The chunk of `column` its Arrow column writer just closed with `close`, each page's header now with the
    /// page's CRC, in file order (the dictionary page first), and its metadata moved to match (offsets relative to
    /// the chunk's start).
    pub(crate) fn take_chunk(&self, column: usize, mut close: ColumnCloseResult) -> Result<(Bytes, ColumnCloseResult)> {
        let blobs = std::mem::take(&mut self.0.lock()[column]);
        if !blobs.len().is_multiple_of(2) {
            return Err(ParquetError::General(format!("column {column}: a page header without its page")));
        }
        let mut dictionary = None;
        let mut data = Vec::with_capacity(blobs.len() / 2);
        for pair in blobs.chunks_exact(2) {
            let (header, page_type) = insert_crc(&pair[0], crc32fast::hash(&pair[1]))?;
            match page_type {
                DICTIONARY_PAGE => dictionary = Some((header, &pair[1])),
                _ => data.push((header, &pair[1])),
            }
        }
        let total = dictionary.iter().chain(&data).map(|(h, p)| h.len() + p.len()).sum();
        let mut chunk = Vec::with_capacity(total);
        let has_dictionary = dictionary.is_some();
        if let Some((header, page)) = dictionary {
            chunk.extend_from_slice(&header);
            chunk.extend_from_slice(page);
        }
        let data_start = chunk.len();
        let mut locations = Vec::with_capacity(data.len());
        for (header, page) in data {
            locations.push((chunk.len() as i64, (header.len() + page.len()) as i32));
            chunk.extend_from_slice(&header);
            chunk.extend_from_slice(page);
        }
        let added = chunk.len() as i64 - close.metadata.compressed_size();
        let uncompressed = close.metadata.uncompressed_size() + added;
        close.metadata = close
            .metadata
            .into_builder()
            .set_dictionary_page_offset(has_dictionary.then_some(0))
            .set_data_page_offset(data_start as i64)
            .set_total_compressed_size(chunk.len() as i64)
            .set_total_uncompressed_size(uncompressed)
            .build()?;
        if let Some(index) = close.offset_index.as_mut() {
            if index.page_locations.len() != locations.len() {
                return Err(ParquetError::General(format!(
                    "column {column}: {} data pages, but {} in its offset index",
                    locations.len(),
                    index.page_locations.len()
                )));
            }
            for (location, (offset, size)) in index.page_locations.iter_mut().zip(locations) {
                location.offset = offset;
                location.compressed_page_size = size;
            }
        }
        close.bytes_written = chunk.len() as u64;
        Ok((Bytes::from(chunk), close))
    }
}

/// `PageType::DICTIONARY_PAGE` in a page header.
const DICTIONARY_PAGE: i32 = 2;

/// `header`, a Thrift (compact protocol) `PageHeader` without a CRC, with field 4 `crc` inserted after its first
/// three (required, in order: type, uncompressed and compressed size); and the page type. The field after the CRC is
/// written relative to the one before it, so its short-form header moves down by one field.
fn insert_crc(header: &[u8], crc: u32) -> Result<(Vec<u8>, i32)> {
    let unexpected = |what: &str| {
        ParquetError::General(format!(
            "a page header the Parquet writer made is not as expected ({what}): {header:02x?}"
        ))
    };
    let mut at = 0;
    let mut page_type = None;
    for _ in 0..3 {
        if header.get(at) != Some(&0x15) {
            return Err(unexpected("fields 1 to 3 are not i32s in order"));
        }
        at += 1;
        let (zigzag, len) = varint(&header[at..]).ok_or_else(|| unexpected("a varint runs past the end"))?;
        page_type.get_or_insert(((zigzag >> 1) as i64 ^ -((zigzag & 1) as i64)) as i32);
        at += len;
    }
    let next = *header.get(at).ok_or_else(|| unexpected("no field stop"))?;
    let mut out = Vec::with_capacity(header.len() + 6);
    out.extend_from_slice(&header[..at]);
    out.push(0x15); // field 4, i32
    uleb128(&mut out, ((crc as i32) << 1 ^ (crc as i32) >> 31) as u32 as u64);
    match next >> 4 {
        0 => out.push(next), // the end of the header, or a field in long form (its id absolute)
        1 => return Err(unexpected("it has a CRC already")),
        delta => out.push((delta - 1) << 4 | next & 0x0f),
    }
    out.extend_from_slice(&header[at + 1..]);
    Ok((out, page_type.unwrap_or_default()))
}

/// An unsigned LEB128 varint at the start of `bytes`, and its length.
fn varint(bytes: &[u8]) -> Option<(u64, usize)> {
    let mut v = 0u64;
    for (i, &b) in bytes.iter().enumerate().take(10) {
        v |= u64::from(b & 0x7f) << (7 * i);
        if b < 0x80 {
            return Some((v, i + 1));
        }
    }
    None
}

/// A page writer for parquet's generic column writer that writes each page behind a header of our own, with its
/// CRC, into a buffer of the file's output (after `lead` bytes, see `Output::adopt`). Page statistics are not
/// written into headers (the column index holds them).
pub(crate) struct ChunkPageWriter<'a> {
    pub(crate) chunk: &'a mut Buffer,
    pub(crate) lead: usize,
}

impl PageWriter for ChunkPageWriter<'_> {
    fn write_page(&mut self, page: CompressedPage) -> Result<PageWriteSpec> {
        let data = page.data();
        let kind = match *page.compressed_page() {
            Page::DataPage { num_values, encoding, def_level_encoding, rep_level_encoding, .. } => {
                if def_level_encoding != rep_level_encoding {
                    return Err(ParquetError::General(format!(
                        "a data page with definition levels in {def_level_encoding} and repetition levels in \
                         {rep_level_encoding}"
                    )));
                }
                PageKind::Data { values: num_values as usize, encoding, levels: def_level_encoding }
            }
            Page::DataPageV2 {
                num_values,
                encoding,
                num_nulls,
                num_rows,
                def_levels_byte_len,
                rep_levels_byte_len,
                is_compressed,
                ..
            } => PageKind::DataV2 {
                values: num_values as usize,
                nulls: num_nulls as usize,
                rows: num_rows as usize,
                encoding,
                def_bytes: def_levels_byte_len as usize,
                rep_bytes: rep_levels_byte_len as usize,
                compressed: is_compressed,
            },
            Page::DictionaryPage { num_values, encoding, is_sorted, .. } => {
                PageKind::Dictionary { values: num_values as usize, encoding, sorted: is_sorted }
            }
        };
        let header = page_header(kind, page.uncompressed_size(), data.len(), crc32fast::hash(data))?;
        let mut spec = PageWriteSpec::new();
        spec.page_type = page.page_type();
        spec.num_values = page.num_values();
        spec.offset = (self.chunk.len() - self.lead) as u64;
        spec.uncompressed_size = page.uncompressed_size() + header.len();
        spec.compressed_size = header.len() + data.len();
        spec.bytes_written = spec.compressed_size as u64;
        self.chunk.extend(&header)?;
        self.chunk.extend(data)?;
        Ok(spec)
    }

    fn close(&mut self) -> Result<()> {
        Ok(())
    }
}

/// The writer under an Arrow IPC file writer: passes every byte on, and takes the CRC-32 of each record batch's
/// stretch of the file when told where one ends ([`BatchCrcs::end_batch`]).
pub struct BatchCrcs<W> {
    inner: W,
    written: u64,
    crc: crc32fast::Hasher,
    /// Per record batch: the file offset its message ends at, and the CRC-32 of the bytes since the previous end.
    batches: Vec<(u64, u32)>,
    /// The footer as the writer writes it, held back until [`BatchCrcs::write_footer`] seals it.
    footer: Option<Vec<u8>>,
}

impl<W: Write> BatchCrcs<W> {
    pub(crate) fn new(inner: W) -> Self {
        BatchCrcs { inner, written: 0, crc: crc32fast::Hasher::new(), batches: Vec::new(), footer: None }
    }

    /// What the IPC writer writes from now on (it finishes the file: end-of-stream marker, footer, length, magic) is
    /// held back for [`write_footer`](Self::write_footer).
    pub(crate) fn hold_footer(&mut self) {
        self.footer = Some(Vec::new());
    }

    /// Seals the held footer and writes it through: the value of [`keys::FOOTER_CRC32`] in the footer's metadata,
    /// written as [`FOOTER_CRC_PLACEHOLDER`], becomes the CRC-32 (8 lowercase hex digits) of every byte after the
    /// last record batch's end (the file's start without one) to the file's end, taken with the placeholder in place.
    ///
    /// [`keys::FOOTER_CRC32`]: crate::dataset::keys::FOOTER_CRC32
    pub(crate) fn write_footer(&mut self) -> std::io::Result<()> {
        let mut tail = self.footer.take().ok_or_else(|| std::io::Error::other("no footer was held"))?;
        let at = footer_crc_range(&tail).map_err(std::io::Error::other)?;
        if tail[at.clone()] != *FOOTER_CRC_PLACEHOLDER.as_bytes() {
            return Err(std::io::Error::other("the footer's CRC-32 value is not the placeholder written"));
        }
        let mut crc = std::mem::take(&mut self.crc); // the bytes since the last batch's end written so far
        crc.update(&tail);
        tail[at].copy_from_slice(format!("{:08x}", crc.finalize()).as_bytes());
        self.inner.write_all(&tail)?;
        self.written += tail.len() as u64;
        Ok(())
    }

    /// Everything written so far belongs to the batch just written (the IPC file writer writes a batch's message
    /// through in full, it buffers nothing).
    pub(crate) fn end_batch(&mut self) {
        let crc = std::mem::take(&mut self.crc).finalize();
        self.batches.push((self.written, crc));
    }

    /// The value of [`keys::BATCH_CRC32`](crate::dataset::keys::BATCH_CRC32): a JSON list of `[end, crc]`.
    pub(crate) fn metadata(&self) -> String {
        serde_json::to_string(&self.batches).expect("a list of number pairs")
    }

    pub(crate) fn into_inner(self) -> W {
        self.inner
    }

    #[cfg(test)]
    pub(crate) fn inner(&self) -> &W {
        &self.inner
    }

    pub(crate) fn inner_mut(&mut self) -> &mut W {
        &mut self.inner
    }
}

impl<W: Write> Write for BatchCrcs<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Some(footer) = &mut self.footer {
            footer.extend_from_slice(buf);
            return Ok(buf.len());
        }
        let n = self.inner.write(buf)?;
        self.crc.update(&buf[..n]);
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// The value of [`keys::FOOTER_CRC32`](crate::dataset::keys::FOOTER_CRC32) as the footer is written, and as it is
/// put back to check it.
pub const FOOTER_CRC_PLACEHOLDER: &str = "00000000";

/// Where, in `tail` (an Arrow IPC file's bytes from some offset to its end), the value of
/// [`keys::FOOTER_CRC32`](crate::dataset::keys::FOOTER_CRC32) lies: the footer is found from the length before the
/// closing magic, and parsed.
fn footer_crc_range(tail: &[u8]) -> Result<std::ops::Range<usize>, String> {
    use crate::dataset::keys;
    let n = tail.len();
    if n < 10 || &tail[n - 6..] != b"ARROW1" {
        return Err("the file does not end in an Arrow IPC footer (length and ARROW1 magic)".into());
    }
    let len = i32::from_le_bytes(tail[n - 10..n - 6].try_into().expect("4 bytes"));
    let start = usize::try_from(len).ok().and_then(|l| (n - 10).checked_sub(l)).ok_or_else(|| {
        format!("the footer's length ({len} bytes) does not fit the {} bytes after the last record batch", n - 10)
    })?;
    let footer = &tail[start..n - 10];
    let parsed = arrow::ipc::root_as_footer(footer).map_err(|e| format!("the footer does not parse: {e}"))?;
    let value = parsed
        .custom_metadata()
        .into_iter()
        .flatten()
        .find(|kv| kv.key() == Some(keys::FOOTER_CRC32))
        .and_then(|kv| kv.value())
        .ok_or_else(|| {
            format!("the footer has no {} (written before footer checksums existed?)", keys::FOOTER_CRC32)
        })?;
    // The value's bytes are in `footer` (flatbuffers strings are read in place).
    let offset =
        (value.as_ptr() as usize).checked_sub(footer.as_ptr() as usize).filter(|o| o + value.len() <= footer.len());
    let offset = offset.ok_or("the footer's CRC-32 value lies outside the footer")?;
    if value.len() != FOOTER_CRC_PLACEHOLDER.len() {
        return Err(format!("{} is {value:?}: not 8 hex digits", keys::FOOTER_CRC32));
    }
    Ok(start + offset..start + offset + value.len())
}

/// Checks the footer checksum of an Arrow IPC file written by this crate: `file` is the whole file, `covered_end`
/// where its last record batch ends (the `end` of the last entry of
/// [`keys::BATCH_CRC32`](crate::dataset::keys::BATCH_CRC32); 0 without batches). With the batch checksums, this
/// covers every byte of the file.
pub fn check_ipc_footer(file: &[u8], covered_end: u64) -> Result<(), String> {
    use crate::dataset::keys;
    let tail = usize::try_from(covered_end).ok().and_then(|e| file.get(e..)).ok_or_else(|| {
        format!("the last record batch ends at byte {covered_end}, past the file's {} bytes", file.len())
    })?;
    let at = footer_crc_range(tail)?;
    // Lowercase only, as written: an upper-case digit would read as the same number, and the value itself is the
    // one stretch the CRC does not cover.
    let value = &tail[at.clone()];
    let want = Some(value)
        .filter(|v| v.iter().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
        .and_then(|v| u32::from_str_radix(std::str::from_utf8(v).ok()?, 16).ok())
        .ok_or_else(|| {
            format!("{} is {:?}: not 8 lowercase hex digits", keys::FOOTER_CRC32, String::from_utf8_lossy(value))
        })?;
    let mut crc = crc32fast::Hasher::new();
    crc.update(&tail[..at.start]);
    crc.update(FOOTER_CRC_PLACEHOLDER.as_bytes());
    crc.update(&tail[at.end..]);
    let got = crc.finalize();
    if got != want {
        return Err(format!(
            "the footer (bytes {covered_end}..{}): CRC-32 {got:08x}, but its metadata says {want:08x}",
            file.len()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use parquet::basic::Encoding;

    /// An Arrow IPC file as [`ArrowIpc`](crate::writing::ArrowIpc) writes it (two record batches, metadata, sealed
    /// footer), and where its last batch ends.
    fn ipc_file() -> (Vec<u8>, u64) {
        use arrow::array::{RecordBatch, UInt64Array};
        use arrow::datatypes::{DataType, Field, Schema};
        let schema = Arc::new(Schema::new(vec![Field::new("step", DataType::UInt64, false)]));
        let mut writer = arrow::ipc::writer::FileWriter::try_new(BatchCrcs::new(Vec::new()), &schema).unwrap();
        for step in 0..2u64 {
            let batch = RecordBatch::try_new(schema.clone(), vec![Arc::new(UInt64Array::from(vec![step; 5]))]).unwrap();
            writer.write(&batch).unwrap();
            writer.get_mut().end_batch();
        }
        writer.write_metadata("ringscope.hookpoint", "layers.0.resid");
        let crcs = writer.get_ref().metadata();
        writer.write_metadata(crate::dataset::keys::BATCH_CRC32, crcs);
        writer.write_metadata(crate::dataset::keys::FOOTER_CRC32, FOOTER_CRC_PLACEHOLDER);
        writer.get_mut().hold_footer();
        writer.finish().unwrap();
        let mut crcs = writer.into_inner().unwrap();
        crcs.write_footer().unwrap();
        let end = crcs.batches.last().unwrap().0;
        (crcs.into_inner(), end)
    }

    #[test]
    fn every_byte_after_the_last_record_batch_is_covered_by_the_footer_crc() {
        let (good, end) = ipc_file();
        assert_eq!(check_ipc_footer(&good, end), Ok(()));
        // Readers read the sealed file as any Arrow IPC file.
        let reader = arrow::ipc::reader::FileReader::try_new(std::io::Cursor::new(good.clone()), None).unwrap();
        assert_eq!(reader.num_batches(), 2);
        assert_eq!(reader.custom_metadata()["ringscope.hookpoint"], "layers.0.resid");
        let sealed = &reader.custom_metadata()[crate::dataset::keys::FOOTER_CRC32];
        assert!(sealed != FOOTER_CRC_PLACEHOLDER && sealed.len() == 8, "{sealed}");
        assert!(good.len() - end as usize > 200, "a footer of {} bytes", good.len() - end as usize);
        for at in end as usize..good.len() {
            for bit in [0x01u8, 0x20, 0x80] {
                let mut bad = good.clone();
                bad[at] ^= bit;
                assert!(
                    check_ipc_footer(&bad, end).is_err(),
                    "byte {at} of {} ^ {bit:#04x} went unnoticed",
                    good.len()
                );
            }
        }
        // A cut file, or a start past its end.
        assert!(check_ipc_footer(&good[..good.len() - 1], end).is_err());
        assert!(check_ipc_footer(&good, good.len() as u64 + 1).is_err());
    }

    #[test]
    fn a_crc_inserted_into_a_header_reads_as_our_own_header_with_it() {
        // Headers without a CRC as parquet's writer makes them: ours with the CRC field cut out (and the next
        // field's delta one larger) must come back whole.
        let kinds = [
            PageKind::Data { values: 1000, encoding: Encoding::RLE_DICTIONARY, levels: Encoding::RLE },
            PageKind::Dictionary { values: 3, encoding: Encoding::PLAIN, sorted: false },
            PageKind::DataV2 {
                values: 9,
                nulls: 1,
                rows: 9,
                encoding: Encoding::PLAIN,
                def_bytes: 4,
                rep_bytes: 0,
                compressed: true,
            },
        ];
        for kind in kinds {
            for crc in [0, 1, 0xdead_beef, 0xffff_ffff] {
                let want = page_header(kind, 5000, 300, crc).unwrap();
                let fields_1_to_3 = 2 + 3 + 3; // 0x15 + one byte (type), 0x15 + two bytes, twice
                let crc_len = 1 + varint(&want[fields_1_to_3 + 1..]).unwrap().1;
                let mut without = want[..fields_1_to_3].to_vec();
                without.push(want[fields_1_to_3 + crc_len] + 0x10);
                without.extend_from_slice(&want[fields_1_to_3 + crc_len + 1..]);
                let (got, page_type) = insert_crc(&without, crc).unwrap();
                assert_eq!(got, want, "{kind:?}, {crc:#x}");
                let want_type = match kind {
                    PageKind::Data { .. } => 0,
                    PageKind::Dictionary { .. } => DICTIONARY_PAGE,
                    PageKind::DataV2 { .. } => 3,
                };
                assert_eq!(page_type, want_type);
                assert!(insert_crc(&got, crc).is_err(), "a second CRC");
            }
        }
        assert!(insert_crc(&[0x15, 0x80], 0).is_err());
    }
}
