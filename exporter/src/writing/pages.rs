//! The activation column of a Parquet row group, written page by page without the generic column writer.
//!
//! The activation column is nearly all of a dump's bytes, and its encoding is trivial: required, no nulls, no
//! dictionary, no statistics, PLAIN — a page is its rows back to back. The generic column writer makes several
//! fresh copies of every page on the way (the value buffer, the page buffer, and a compression buffer that is
//! reallocated once more before compressing), each in newly allocated memory that page-faults. Here a record of
//! 64 KiB or more is compressed where it lies, as one page or more; smaller records are gathered into a reused page
//! buffer first. One reused zstd context compresses each page, behind its page header, straight into a buffer of the
//! file's [`Output`], which that buffer then joins at the chunk's place in the stream through [`SpliceWriter`]: the
//! compressed bytes are never copied. Measurements in `docs/benchmarks.md`.

use std::io::{Read, Write};

use bytes::Bytes;
use parquet::basic::{Compression, Encoding, ZstdLevel};
use parquet::column::writer::ColumnCloseResult;
use parquet::errors::{ParquetError, Result};
use parquet::file::metadata::{ColumnChunkMetaData, OffsetIndexBuilder};
use parquet::file::reader::{ChunkReader, Length};
use parquet::schema::types::ColumnDescPtr;

use crate::routing::record::Record;
use crate::writing::output::{Buffer, Output};

/// See [`ActivationPages::encode`].
const DIRECT_PAGE_MIN: usize = 64 << 10;

/// Builds one row group's activation column chunk; reused across row groups (its buffers keep their capacity).
pub(crate) struct ActivationPages {
    level: ZstdLevel,
    compressor: zstd::bulk::Compressor<'static>,
    page_bytes: usize,
    page: Vec<u8>,
    /// The last page's compressed size: the next page's header slot is sized for it (see [`compress_page`]).
    last_compressed: usize,
}

/// The column chunk being assembled: its pages and the bookkeeping for its metadata.
struct Assembly {
    /// Bytes of the buffer before the chunk.
    lead: usize,
    row_bytes: usize,
    rows: u64,
    uncompressed: u64,
    offsets: OffsetIndexBuilder,
    /// The compressed size the next page's header slot is sized for (0: zstd's worst case).
    expect_compressed: usize,
    /// Pages whose header came out shorter or longer than its slot, so that the page was moved to close the gap.
    moved: u64,
}

impl Assembly {
    /// A chunk with no pages yet, after `lead` bytes; its first header slot sized for `expect_compressed` (0: zstd's
    /// worst case).
    fn new(lead: usize, row_bytes: usize, expect_compressed: usize) -> Self {
        Assembly { lead, row_bytes, rows: 0, uncompressed: 0, offsets: Default::default(), expect_compressed, moved: 0 }
    }
}

impl ActivationPages {
    /// Pages of about `page_bytes` raw bytes (whole rows), zstd at `level`.
    pub(crate) fn new(level: ZstdLevel, page_bytes: usize) -> Result<Self> {
        let zstd_error = |e| ParquetError::General(format!("zstd level {}: {e}", level.compression_level()));
        let mut compressor = zstd::bulk::Compressor::new(level.compression_level()).map_err(zstd_error)?;
        // Each page's frame ends with a checksum of its uncompressed bytes (4 bytes of XXH64), which every zstd
        // decoder checks: a page whose CRC a reader does not check still cannot decode to wrong values silently.
        compressor.set_parameter(zstd::zstd_safe::CParameter::ChecksumFlag(true)).map_err(zstd_error)?;
        Ok(ActivationPages { level, compressor, page_bytes: page_bytes.max(1), page: Vec::new(), last_compressed: 0 })
    }

    /// Encodes the rows of `records` (rows of `row_bytes` each, checked by the caller) as the column chunk of
    /// `column` into `chunk`, after `lead` bytes left for [`Output::adopt`]; returns what the file writer needs to
    /// know about it.
    pub(crate) fn encode(
        &mut self,
        column: ColumnDescPtr,
        records: &[Record],
        row_bytes: usize,
        chunk: &mut Buffer,
        lead: usize,
    ) -> Result<ColumnCloseResult> {
        let page_cap = (self.page_bytes / row_bytes).max(1) * row_bytes;
        if self.page.capacity() < page_cap {
            // Sized by `export.page_bytes`: refused memory fails the sink (counted), it does not abort.
            self.page.try_reserve_exact(page_cap - self.page.len()).map_err(|e| {
                ParquetError::General(format!("a {page_cap}-byte page buffer could not be allocated: {e}"))
            })?;
        }
        chunk.clear();
        // All the pages' room at once: a buffer grown page by page is mapped anew and copied at every step (a dozen
        // times, ~3x the chunk's bytes copied, for a 64 MiB record into the default 4.6 MiB buffer).
        chunk.reserve(chunk_bound(records.iter().map(|r| r.data().len()), page_cap, lead))?;
        chunk.extend(&[0; crate::writing::output::ALIGN][..lead])?;
        let mut asm = Assembly::new(lead, row_bytes, self.last_compressed);
        // Records at least this big become pages of their own, compressed in place (no copy); smaller ones are
        // gathered into page-sized pages. zstd compresses 64 KiB pages as well as 1 MiB ones: it works in blocks of
        // at most 128 KiB either way.
        let direct_min = page_cap.min((DIRECT_PAGE_MIN / row_bytes).max(1) * row_bytes);
        for record in records {
            let data = record.data();
            if data.len() >= direct_min {
                // Big enough to be pages of its own: compressed where it lies, after the rows gathered before it.
                self.flush_page(chunk, &mut asm)?;
                for piece in data.chunks(page_cap) {
                    compress_page(&mut self.compressor, chunk, piece, &mut asm)?;
                }
                continue;
            }
            let mut data = data;
            while !data.is_empty() {
                let take = data.len().min(page_cap - self.page.len());
                self.page.extend_from_slice(&data[..take]);
                data = &data[take..];
                if self.page.len() == page_cap {
                    self.flush_page(chunk, &mut asm)?;
                }
            }
        }
        self.flush_page(chunk, &mut asm)?;
        self.last_compressed = asm.expect_compressed;
        let len = (chunk.len() - lead) as u64;
        let metadata = ColumnChunkMetaData::builder(column)
            .set_compression(Compression::ZSTD(self.level))
            .set_encodings(vec![Encoding::PLAIN, Encoding::RLE])
            .set_num_values(asm.rows as i64)
            .set_total_compressed_size(len as i64)
            .set_total_uncompressed_size(asm.uncompressed as i64)
            .set_data_page_offset(0)
            .build()?;
        let close = ColumnCloseResult {
            bytes_written: len,
            rows_written: asm.rows,
            metadata,
            bloom_filter: None,
            column_index: None,
            offset_index: Some(asm.offsets.build()),
        };
        Ok(close)
    }

    /// Compresses the gathered rows, if any, as one page.
    fn flush_page(&mut self, chunk: &mut Buffer, asm: &mut Assembly) -> Result<()> {
        if !self.page.is_empty() {
            compress_page(&mut self.compressor, chunk, &self.page, asm)?;
            self.page.clear();
        }
        Ok(())
    }
}

/// Compresses `rows` (whole rows, back to back) straight into `chunk`, after a slot for its page header that is then
/// filled in. The header's size depends on the compressed size and the CRC only through the lengths of their varints,
/// so the slot is sized for the previous page's compressed size (pages of one hookpoint compress alike) and the
/// widest CRC: the header fills it exactly unless the varint of the compressed size came out a byte longer or
/// shorter, or the CRC is small (1 page in 16), and only then is the page moved by those few bytes. (A slot sized
/// for zstd's worst case instead moved every 1 MiB page: its bound takes a 4-byte varint, 0.8 MiB a 3-byte one.)
fn compress_page(
    compressor: &mut zstd::bulk::Compressor<'static>,
    chunk: &mut Buffer,
    rows: &[u8],
    asm: &mut Assembly,
) -> Result<()> {
    let n = rows.len() / asm.row_bytes;
    let bound = zstd::zstd_safe::compress_bound(rows.len());
    let expect = if asm.expect_compressed == 0 { bound } else { asm.expect_compressed.min(bound) };
    let slot = data_page_header(rows.len(), expect, n, WIDEST_CRC)?.len();
    let start = chunk.len();
    chunk.reserve(HEADER_MAX + bound)?;
    chunk.extend(&[0; HEADER_MAX][..slot])?;
    let compressed =
        compressor.compress_to_buffer(rows, chunk.spare()).map_err(|e| ParquetError::General(format!("zstd: {e}")))?;
    chunk.advance(compressed);
    asm.expect_compressed = compressed;
    let crc = crc32fast::hash(&chunk.bytes()[start + slot..start + slot + compressed]);
    let header = data_page_header(rows.len(), compressed, n, crc)?;
    if header.len() > slot {
        chunk.advance(header.len() - slot); // within the HEADER_MAX + bound reserved above
    }
    let bytes = chunk.bytes_mut();
    if header.len() != slot {
        bytes.copy_within(start + slot..start + slot + compressed, start + header.len());
        asm.moved += 1;
    }
    bytes[start..start + header.len()].copy_from_slice(&header);
    chunk.truncate(start + header.len() + compressed);
    asm.offsets.append_offset_and_size((start - asm.lead) as i64, (header.len() + compressed) as i32);
    asm.offsets.append_row_count(n as i64);
    asm.uncompressed += (header.len() + rows.len()) as u64;
    asm.rows += n as u64;
    Ok(())
}

/// More than any page header (at most 29 bytes).
const HEADER_MAX: usize = 64;

/// At least the bytes [`ActivationPages::encode`] writes for records of `sizes` bytes in pages of at most `page_cap`
/// bytes after `lead` bytes: every page's header room and zstd's bound (`x + x/256`, plus at most 64 bytes for a
/// page under 128 KiB), for at most one page per `page_cap` bytes plus one per record (a record ends a page at most
/// once).
fn chunk_bound(sizes: impl Iterator<Item = usize>, page_cap: usize, lead: usize) -> usize {
    let (raw, records) = sizes.fold((0usize, 0usize), |(raw, n), s| (raw.saturating_add(s), n + 1));
    let pages = (raw / page_cap.max(1)).saturating_add(records).saturating_add(1);
    lead.saturating_add(raw).saturating_add(raw / 256).saturating_add(pages.saturating_mul(HEADER_MAX + 64))
}

/// The Thrift (compact protocol) `PageHeader` of a version-1 data page of PLAIN values, RLE level encodings, no
/// statistics, its CRC `crc` (see [`page_header`]).
fn data_page_header(uncompressed: usize, compressed: usize, rows: usize, crc: u32) -> Result<Vec<u8>> {
    let kind = PageKind::Data { values: rows, encoding: Encoding::PLAIN, levels: Encoding::RLE };
    page_header(kind, uncompressed, compressed, crc)
}

/// The CRC whose varint in a page header is longest (zigzag `u32::MAX`: five bytes), for sizing a header slot
/// before the page's bytes, and so its CRC, are known.
const WIDEST_CRC: u32 = 0x8000_0000;

/// A page's kind and what its header says about its values.
#[derive(Debug, Clone, Copy)]
pub(crate) enum PageKind {
    /// A version-1 data page: `values` values (nulls included) in `encoding`; levels, if any, in `levels`.
    Data { values: usize, encoding: Encoding, levels: Encoding },
    /// A version-2 data page: levels uncompressed in front of the (maybe compressed) values.
    DataV2 {
        values: usize,
        nulls: usize,
        rows: usize,
        encoding: Encoding,
        def_bytes: usize,
        rep_bytes: usize,
        compressed: bool,
    },
    /// A dictionary page of `values` values in `encoding`.
    Dictionary { values: usize, encoding: Encoding, sorted: bool },
}

/// The Thrift (compact protocol) `PageHeader` of a page with CRC-32 `crc` (of the page's bytes as they are in the
/// file, after this header, as the Parquet format specifies), without statistics. Field by field from
/// parquet.thrift: `PageHeader { 1: type, 2: uncompressed_page_size, 3: compressed_page_size, 4: crc,
/// 5: data_page_header, 7: dictionary_page_header, 8: data_page_header_v2 }`, `DataPageHeader { 1: num_values,
/// 2: encoding, 3: definition_level_encoding, 4: repetition_level_encoding }`, `DictionaryPageHeader { 1: num_values,
/// 2: encoding, 3: is_sorted }` and `DataPageHeaderV2 { 1: num_values, 2: num_nulls, 3: num_rows, 4: encoding,
/// 5: definition_levels_byte_length, 6: repetition_levels_byte_length, 7: is_compressed }`.
pub(crate) fn page_header(kind: PageKind, uncompressed: usize, compressed: usize, crc: u32) -> Result<Vec<u8>> {
    let int = |v: usize, what: &str| {
        i32::try_from(v).map_err(|_| ParquetError::General(format!("a page's {what} ({v}) exceeds i32")))
    };
    const I32: u8 = 5; // compact-protocol type ids
    const TRUE: u8 = 1;
    const FALSE: u8 = 2;
    const STRUCT: u8 = 12;
    let mut out = Vec::with_capacity(40);
    let field = |out: &mut Vec<u8>, delta: u8, ty: u8| out.push(delta << 4 | ty);
    let i32v = |out: &mut Vec<u8>, v: i32| uleb128(out, ((v << 1) ^ (v >> 31)) as u32 as u64); // zigzag first
    let page_type = match kind {
        PageKind::Data { .. } => 0,
        PageKind::Dictionary { .. } => 2,
        PageKind::DataV2 { .. } => 3,
    };
    field(&mut out, 1, I32);
    i32v(&mut out, page_type);
    field(&mut out, 1, I32);
    i32v(&mut out, int(uncompressed, "uncompressed size")?);
    field(&mut out, 1, I32);
    i32v(&mut out, int(compressed, "compressed size")?);
    field(&mut out, 1, I32);
    i32v(&mut out, crc as i32); // Thrift has no unsigned integers: the CRC's bits as an i32
    match kind {
        PageKind::Data { values, encoding, levels } => {
            field(&mut out, 1, STRUCT); // field 5, after field 4
            field(&mut out, 1, I32);
            i32v(&mut out, int(values, "value count")?);
            field(&mut out, 1, I32);
            i32v(&mut out, encoding as i32);
            field(&mut out, 1, I32);
            i32v(&mut out, levels as i32);
            field(&mut out, 1, I32);
            i32v(&mut out, levels as i32);
        }
        PageKind::Dictionary { values, encoding, sorted } => {
            field(&mut out, 3, STRUCT); // field 7, after field 4
            field(&mut out, 1, I32);
            i32v(&mut out, int(values, "value count")?);
            field(&mut out, 1, I32);
            i32v(&mut out, encoding as i32);
            field(&mut out, 1, if sorted { TRUE } else { FALSE });
        }
        PageKind::DataV2 { values, nulls, rows, encoding, def_bytes, rep_bytes, compressed } => {
            field(&mut out, 4, STRUCT); // field 8, after field 4
            for (v, what) in [(values, "value count"), (nulls, "null count"), (rows, "row count")] {
                field(&mut out, 1, I32);
                i32v(&mut out, int(v, what)?);
            }
            field(&mut out, 1, I32);
            i32v(&mut out, encoding as i32);
            for (v, what) in [(def_bytes, "definition level bytes"), (rep_bytes, "repetition level bytes")] {
                field(&mut out, 1, I32);
                i32v(&mut out, int(v, what)?);
            }
            field(&mut out, 1, if compressed { TRUE } else { FALSE });
        }
    }
    out.push(0); // end of the inner header
    out.push(0); // end of PageHeader
    Ok(out)
}

/// `v` as an unsigned LEB128 varint (Thrift's compact protocol, Parquet's RLE run headers).
pub(crate) fn uleb128(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// What the Parquet file writer copies as the activation column chunk: as many bytes as the chunk has, of no
/// meaning. The real bytes reach the file through [`SpliceWriter`], which drops these.
pub(crate) struct Placeholder(pub(crate) u64);

/// A reader that "reads" whatever its caller's buffer already holds: the placeholder's bytes are dropped unread, so
/// they need not be written (zeroing them was half a percent of the sink's time).
pub(crate) struct Unread;

impl Read for Unread {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        Ok(buf.len())
    }
}

impl Length for Placeholder {
    fn len(&self) -> u64 {
        self.0
    }
}

impl ChunkReader for Placeholder {
    type T = std::io::Take<Unread>;

    fn get_read(&self, start: u64) -> Result<Self::T> {
        Ok(Unread.take(self.0.saturating_sub(start)))
    }

    fn get_bytes(&self, _start: u64, _length: usize) -> Result<Bytes> {
        Err(ParquetError::General("the activation chunk placeholder has no bytes to read".into()))
    }
}

/// The file under a Parquet file writer, with one addition: a byte range of the stream can be *spliced* — its
/// bytes given in advance in a buffer of the file's [`Output`], which joins the stream when it reaches the range,
/// while the bytes the Parquet writer sends for that range are dropped. The activation column chunk goes to the file
/// this way, compressed straight into its place: the writer's own splice (`append_column`) would copy it through an
/// 8 KiB buffer and our buffer once more. The writer's offset bookkeeping is untouched (it sends exactly the chunk's
/// length), and the caller checks afterwards that the writer placed the column chunk where the splice put it.
pub(crate) struct SpliceWriter {
    out: Output,
    /// Bytes the Parquet writer sent so far (the output is ahead of it while it sends a spliced range).
    pos: u64,
    splice: Option<Splice>,
}

struct Splice {
    start: u64,
    len: u64,
    /// The buffer (its first `lead` bytes stand for the stream's last ones, see [`Output::adopt`]) until adopted.
    chunk: Option<(Buffer, usize)>,
}

impl SpliceWriter {
    pub(crate) fn new(out: Output) -> Self {
        SpliceWriter { out, pos: 0, splice: None }
    }

    /// The file's output (for buffers to encode into).
    pub(crate) fn output(&mut self) -> &mut Output {
        &mut self.out
    }

    /// Stream bytes `start .. start + len` are `chunk`'s bytes after its first `lead`.
    pub(crate) fn splice(&mut self, start: u64, chunk: Buffer, lead: usize) -> std::io::Result<()> {
        let pos = self.pos;
        if self.splice.is_some() || start < pos || chunk.len() < lead {
            return Err(std::io::Error::other(format!(
                "cannot splice at byte {start}: the stream is at {pos}, a splice is pending or the chunk is short"
            )));
        }
        let len = (chunk.len() - lead) as u64;
        self.splice = Some(Splice { start, len, chunk: Some((chunk, lead)) });
        Ok(())
    }

    /// Ends the splice; an error if the stream has not passed all of it.
    pub(crate) fn end_splice(&mut self) -> std::io::Result<()> {
        let s = self.splice.take().ok_or_else(|| std::io::Error::other("no splice is pending"))?;
        let pos = self.pos;
        if let Some((chunk, _)) = s.chunk {
            if s.len > 0 || pos < s.start {
                return Err(std::io::Error::other(format!(
                    "the Parquet writer stopped at byte {pos} before the spliced chunk at {}..{}",
                    s.start,
                    s.start + s.len
                )));
            }
            self.out.recycle(chunk); // empty: nothing to adopt
        } else if pos < s.start + s.len {
            return Err(std::io::Error::other(format!(
                "the Parquet writer stopped at byte {pos} inside the spliced chunk at {}..{}",
                s.start,
                s.start + s.len
            )));
        }
        Ok(())
    }

    /// The file, every byte written (see [`Output::finish`]).
    pub(crate) fn into_inner(self) -> Output {
        self.out
    }
}

impl Write for SpliceWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut rest = buf;
        while !rest.is_empty() {
            let (start, end) = match &self.splice {
                Some(s) => (s.start, s.start + s.len),
                None => (u64::MAX, u64::MAX),
            };
            let k = if self.pos < start {
                let k = rest.len().min(usize::try_from(start - self.pos).unwrap_or(usize::MAX));
                self.out.write_all(&rest[..k])?;
                k
            } else if self.pos < end {
                if let Some((chunk, lead)) = self.splice.as_mut().and_then(|s| s.chunk.take()) {
                    self.out.adopt(chunk, lead)?; // the chunk's bytes: the output is now past the range
                }
                rest.len().min(usize::try_from(end - self.pos).unwrap_or(usize::MAX))
            } else {
                self.out.write_all(rest)?;
                rest.len()
            };
            self.pos += k as u64;
            rest = &rest[k..];
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("ringscope-{name}-{}", std::process::id()))
    }

    /// A page writer (zstd(1), pages of `page_bytes`) and an output buffer of a scratch file at `path`.
    fn page_writer(path: &std::path::Path, page_bytes: usize) -> (ActivationPages, Buffer) {
        let mut out = Output::create(path, crate::dataset::DirectIo::Off, page_bytes).unwrap();
        let chunk = out.take_buffer().unwrap();
        (ActivationPages::new(ZstdLevel::try_new(1).unwrap(), page_bytes).unwrap(), chunk)
    }

    /// `n` bytes of xorshift noise from `state`, each through `shape` (its index and a fresh random word).
    fn noise(state: &mut u64, n: usize, shape: impl Fn(usize, u64) -> u8) -> Vec<u8> {
        (0..n)
            .map(|i| {
                *state ^= *state << 13;
                *state ^= *state >> 7;
                *state ^= *state << 17;
                shape(i, *state)
            })
            .collect()
    }

    #[test]
    fn a_splice_replaces_exactly_its_byte_range_whatever_the_write_sizes() {
        use crate::dataset::DirectIo;
        use crate::writing::output::ALIGN;
        let path = scratch("splice");
        let stream: Vec<u8> = (0..30_000u32).map(|i| (i % 251) as u8).collect();
        let spliced: Vec<u8> = (0..9_000u32).map(|i| 255 - (i % 7) as u8).collect();
        // Through the page cache and (where the file system has it) O_DIRECT; buffers of two blocks, so the stream
        // crosses many buffers and the chunk is adopted in the middle of one.
        for direct_io in [DirectIo::Off, DirectIo::Auto] {
            for write_size in [1, 7, 4096, 30_000] {
                let mut out = Output::create(&path, direct_io, 2 * ALIGN).unwrap();
                let start = 5_000u64;
                let lead = start as usize % ALIGN;
                let mut chunk = out.take_buffer().unwrap();
                chunk.extend(&vec![9; lead]).unwrap();
                chunk.extend(&spliced).unwrap();
                let mut w = SpliceWriter::new(out);
                w.write_all(&stream[..100]).unwrap();
                w.splice(start, chunk, lead).unwrap();
                let other = w.output().take_buffer().unwrap();
                assert!(w.splice(20_000, other, 0).is_err(), "one splice at a time");
                for piece in stream[100..].chunks(write_size) {
                    w.write_all(piece).unwrap();
                }
                w.end_splice().unwrap();
                w.into_inner().finish().unwrap();
                let mut want = stream.clone();
                want[5_000..14_000].copy_from_slice(&spliced);
                assert_eq!(std::fs::read(&path).unwrap(), want, "{direct_io:?}, writes of {write_size}");
            }
        }
        // An empty splice is done once the stream reaches it.
        let mut w = SpliceWriter::new(Output::create(&path, DirectIo::Off, ALIGN).unwrap());
        let empty = w.output().take_buffer().unwrap();
        w.splice(3, empty, 0).unwrap();
        w.write_all(&[1, 2, 3, 4]).unwrap();
        w.end_splice().unwrap();
        // A stream that stops inside the splice, or before it, is an error, not a silently short file.
        for stop in [50, 10] {
            let mut w = SpliceWriter::new(Output::create(&path, DirectIo::Off, ALIGN).unwrap());
            let mut chunk = w.output().take_buffer().unwrap();
            chunk.extend(&[0; 20 + 100]).unwrap();
            w.splice(20, chunk, 20).unwrap();
            w.write_all(&vec![0; stop]).unwrap();
            let e = w.end_splice().unwrap_err().to_string();
            assert!(e.contains("stopped at byte"), "{e}");
        }
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn page_headers_use_the_compact_protocol() {
        // Small sizes: one varint byte each (zigzag doubles them); the CRC's bits as an i32, zigzagged.
        assert_eq!(
            data_page_header(100, 60, 5, 3).unwrap(),
            vec![0x15, 0x00, 0x15, 200, 0x01, 0x15, 120, 0x15, 6, 0x1c, 0x15, 10, 0x15, 0x00, 0x15, 6, 0x15, 6, 0, 0]
        );
        // 1 MiB: zigzag 2^21 → three LEB128 bytes.
        let h = data_page_header(1 << 20, 1, 1, 0).unwrap();
        assert_eq!(&h[2..7], &[0x15, 0x80, 0x80, 0x80, 0x01]);
        assert!(data_page_header(1 << 31, 1, 1, 0).unwrap_err().to_string().contains("uncompressed size"));
        // No CRC makes a longer header than the widest one, which sizes the slot a page is compressed behind.
        let widest = data_page_header(10, 10, 1, WIDEST_CRC).unwrap().len();
        for crc in [0, 1, 0x7fff_ffff, 0xffff_ffff, 0x1234_5678, 0xdead_beef] {
            assert!(data_page_header(10, 10, 1, crc).unwrap().len() <= widest, "{crc:#x}");
        }
    }

    #[test]
    fn pages_are_compressed_in_place_behind_a_header_slot_that_fits_and_read_back_whole() {
        let path = scratch("slot");
        let (mut pages, mut chunk) = page_writer(&path, 1 << 20);
        let mut asm = Assembly::new(0, 4096, 0);
        // bf16-like rows: a random low byte, a high byte from a few values (1 MiB pages compress to ~0.6 MiB, whose
        // size takes a shorter varint than zstd's bound for 1 MiB).
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let bf16 = |i: usize, r: u64| if i.is_multiple_of(2) { r as u8 } else { 0x3c + (r >> 40) as u8 % 4 };
        let want: Vec<Vec<u8>> = (0..48).map(|_| noise(&mut x, 1 << 20, bf16)).collect();
        for rows in &want {
            compress_page(&mut pages.compressor, &mut chunk, rows, &mut asm).unwrap();
        }
        // Only the first page (sized for the bound) and pages whose CRC has a short varint (1 in 16) are moved.
        assert!(asm.moved <= 1 + 48 / 4, "{} of 48 pages moved", asm.moved);
        // Every page: its header, then exactly its compressed bytes, decoding to its rows.
        let bytes = chunk.bytes();
        let mut at = 0;
        for rows in &want {
            let mut fields = Vec::new();
            for _ in 0..4 {
                assert_eq!(bytes[at], 0x15);
                at += 1;
                let (mut z, mut shift) = (0u64, 0);
                loop {
                    let b = bytes[at];
                    at += 1;
                    z |= u64::from(b & 0x7f) << shift;
                    shift += 7;
                    if b < 0x80 {
                        break;
                    }
                }
                fields.push(((z >> 1) as i64) ^ -((z & 1) as i64));
            }
            // The data page header (its field byte, then 256 values: a 2-byte varint, 3 one-byte fields), the
            // stop bytes of it and of the page header.
            at += 10;
            assert_eq!(&bytes[at..at + 2], &[0, 0], "end of the page header");
            at += 2;
            let compressed = fields[2] as usize;
            let body = &bytes[at..at + compressed];
            assert_eq!(fields[3] as i32 as u32, crc32fast::hash(body));
            assert_eq!(&zstd::bulk::decompress(body, rows.len()).unwrap(), rows);
            at += compressed;
        }
        assert_eq!(at, bytes.len());
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_chunks_room_reserved_up_front_holds_every_page_even_of_incompressible_rows() {
        let path = scratch("bound");
        let (mut pages, mut chunk) = page_writer(&path, 1 << 16);
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let page_cap = 1 << 17;
        let lead = 1000;
        // Records cut into pages of `page_cap` (the last one short), a small record as one page, rows of 1 byte.
        let records: Vec<Vec<u8>> =
            [3 * page_cap + 17, 5000, page_cap, 1].iter().map(|&n| noise(&mut x, n, |_, r| r as u8)).collect();
        let bound = chunk_bound(records.iter().map(Vec::len), page_cap, lead);
        chunk.reserve(bound).unwrap();
        let reserved = chunk.spare().len();
        chunk.extend(&vec![0; lead]).unwrap();
        let mut asm = Assembly::new(lead, 1, 0);
        for r in &records {
            for piece in r.chunks(page_cap) {
                compress_page(&mut pages.compressor, &mut chunk, piece, &mut asm).unwrap();
            }
        }
        assert!(chunk.len() <= bound, "{} bytes written, {bound} reserved", chunk.len());
        assert_eq!(chunk.len() + chunk.spare().len(), reserved, "the buffer never grew");
        let raw: usize = records.iter().map(Vec::len).sum();
        assert!(chunk.len() > raw, "incompressible: the pages are larger than the rows");
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn activation_pages_carry_their_crc_and_a_zstd_frame_checksum() {
        use crate::dataset::DirectIo;
        let path = scratch("crc");
        let mut out = Output::create(&path, DirectIo::Off, 1 << 20).unwrap();
        let mut chunk = out.take_buffer().unwrap();
        let mut pages = ActivationPages::new(ZstdLevel::try_new(1).unwrap(), 1 << 16).unwrap();
        let rows: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 253) as u8).collect();
        let mut asm = Assembly::new(0, 100, 0);
        compress_page(&mut pages.compressor, &mut chunk, &rows, &mut asm).unwrap();
        let bytes = chunk.bytes();
        // Header fields 1-3 (three zigzag varints after their 0x15 field bytes), then field 4, the CRC.
        let mut at = 0;
        let varint = |at: &mut usize| {
            let (mut v, mut shift) = (0u64, 0);
            loop {
                let b = bytes[*at];
                *at += 1;
                v |= u64::from(b & 0x7f) << shift;
                shift += 7;
                if b < 0x80 {
                    return v;
                }
            }
        };
        let mut fields = Vec::new();
        for _ in 0..4 {
            assert_eq!(bytes[at], 0x15);
            at += 1;
            let z = varint(&mut at);
            fields.push(((z >> 1) as i64) ^ -((z & 1) as i64));
        }
        let compressed = fields[2] as usize;
        let header_len = bytes.len() - compressed;
        let page = &bytes[header_len..];
        assert_eq!(fields[3] as i32 as u32, crc32fast::hash(page));
        // A zstd frame whose descriptor has the content-checksum bit, decoding to the rows.
        assert_eq!(&page[..4], &[0x28, 0xb5, 0x2f, 0xfd]);
        assert_ne!(page[4] & 0x04, 0, "content checksum flag");
        assert_eq!(zstd::bulk::decompress(page, rows.len()).unwrap(), rows);
        let mut flipped = page.to_vec();
        let last = flipped.len() - 1;
        flipped[last] ^= 1; // in the frame checksum itself
        assert!(zstd::bulk::decompress(&flipped, rows.len()).is_err());
        let _ = std::fs::remove_file(&path);
    }
}
