//! The activation column of a Parquet row group, written page by page without the generic column writer.
//!
//! The activation column is nearly all of a dump's bytes, and its encoding is trivial: required, no nulls, no
//! dictionary, no statistics, PLAIN — a page is its rows back to back. The generic column writer makes several
//! fresh copies of every page on the way (the value buffer, the page buffer, and a compression buffer that is
//! reallocated once more before compressing), each in newly allocated memory that page-faults. Here a record of
//! 64 KiB or more is compressed where it lies, as one page or more; smaller records are gathered into a reused page
//! buffer first. One reused zstd context compresses each page into a reused buffer, and the page goes, after its
//! header, into the row group's column chunk — a reused buffer that the Parquet file writer splices into the file.
//! Measurements in `docs/benchmarks.md`.

use std::io::Read;

use bytes::Bytes;
use parquet::basic::{Compression, Encoding, ZstdLevel};
use parquet::column::writer::ColumnCloseResult;
use parquet::errors::{ParquetError, Result};
use parquet::file::metadata::{ColumnChunkMetaData, OffsetIndexBuilder};
use parquet::file::reader::{ChunkReader, Length};
use parquet::schema::types::ColumnDescPtr;

use crate::record::Record;

/// See [`ActivationPages::encode`].
const DIRECT_PAGE_MIN: usize = 64 << 10;

/// Builds one row group's activation column chunk; reused across row groups (its buffers keep their capacity).
pub(crate) struct ActivationPages {
    level: ZstdLevel,
    compressor: zstd::bulk::Compressor<'static>,
    page_bytes: usize,
    page: Vec<u8>,
    chunk: Vec<u8>,
}

/// What a finished chunk says about itself (see [`ActivationPages::finish`]).
pub(crate) struct Chunk<'a> {
    pub(crate) bytes: ChunkSlice<'a>,
    pub(crate) close: ColumnCloseResult,
}

/// The column chunk being assembled: its pages and the bookkeeping for its metadata.
struct Assembly {
    row_bytes: usize,
    rows: u64,
    uncompressed: u64,
    offsets: OffsetIndexBuilder,
}

impl ActivationPages {
    /// Pages of about `page_bytes` raw bytes (whole rows), zstd at `level`.
    pub(crate) fn new(level: ZstdLevel, page_bytes: usize) -> Result<Self> {
        let compressor = zstd::bulk::Compressor::new(level.compression_level())
            .map_err(|e| ParquetError::General(format!("zstd level {}: {e}", level.compression_level())))?;
        Ok(ActivationPages { level, compressor, page_bytes: page_bytes.max(1), page: Vec::new(), chunk: Vec::new() })
    }

    /// Encodes the rows of `records` (rows of `row_bytes` each, checked by the caller) as the column chunk of
    /// `column`.
    pub(crate) fn encode<'s>(
        &'s mut self,
        column: ColumnDescPtr,
        records: &[Record],
        row_bytes: usize,
    ) -> Result<Chunk<'s>> {
        let page_cap = (self.page_bytes / row_bytes).max(1) * row_bytes;
        if self.page.capacity() < page_cap {
            self.page.reserve_exact(page_cap);
        }
        self.chunk.clear();
        let mut asm = Assembly { row_bytes, rows: 0, uncompressed: 0, offsets: Default::default() };
        // Records at least this big become pages of their own, compressed in place (no copy); smaller ones are
        // gathered into page-sized pages. zstd compresses 64 KiB pages as well as 1 MiB ones: it works in blocks of
        // at most 128 KiB either way.
        let direct_min = page_cap.min((DIRECT_PAGE_MIN / row_bytes).max(1) * row_bytes);
        for record in records {
            let data = record.data();
            if data.len() >= direct_min {
                // Big enough to be pages of its own: compressed where it lies, after the rows gathered before it.
                self.flush_page(&mut asm)?;
                for piece in data.chunks(page_cap) {
                    compress_page(&mut self.compressor, &mut self.chunk, piece, row_bytes, &mut asm)?;
                }
                continue;
            }
            let mut data = data;
            while !data.is_empty() {
                let take = data.len().min(page_cap - self.page.len());
                self.page.extend_from_slice(&data[..take]);
                data = &data[take..];
                if self.page.len() == page_cap {
                    self.flush_page(&mut asm)?;
                }
            }
        }
        self.flush_page(&mut asm)?;
        let metadata = ColumnChunkMetaData::builder(column)
            .set_compression(Compression::ZSTD(self.level))
            .set_encodings(vec![Encoding::PLAIN, Encoding::RLE])
            .set_num_values(asm.rows as i64)
            .set_total_compressed_size(self.chunk.len() as i64)
            .set_total_uncompressed_size(asm.uncompressed as i64)
            .set_data_page_offset(0)
            .build()?;
        let close = ColumnCloseResult {
            bytes_written: self.chunk.len() as u64,
            rows_written: asm.rows,
            metadata,
            bloom_filter: None,
            column_index: None,
            offset_index: Some(asm.offsets.build()),
        };
        Ok(Chunk { bytes: ChunkSlice(&self.chunk), close })
    }

    /// Compresses the gathered rows, if any, as one page.
    fn flush_page(&mut self, asm: &mut Assembly) -> Result<()> {
        if !self.page.is_empty() {
            compress_page(&mut self.compressor, &mut self.chunk, &self.page, asm.row_bytes, asm)?;
            self.page.clear();
        }
        Ok(())
    }
}

/// Compresses `rows` (whole rows, back to back) straight into `chunk`, after a slot for its page header that is then
/// filled in: the header's size depends on the compressed size only through the length of a varint, so a slot sized
/// for zstd's worst case fits exactly in the common case, and the page moves back a byte or two otherwise.
fn compress_page(
    compressor: &mut zstd::bulk::Compressor<'static>,
    chunk: &mut Vec<u8>,
    rows: &[u8],
    row_bytes: usize,
    asm: &mut Assembly,
) -> Result<()> {
    let n = rows.len() / row_bytes;
    let bound = zstd::zstd_safe::compress_bound(rows.len());
    let slot = data_page_header(rows.len(), bound, n)?.len();
    let start = chunk.len();
    chunk.reserve(slot + bound);
    let mut out = std::io::Cursor::new(&mut *chunk);
    out.set_position((start + slot) as u64);
    let compressed =
        compressor.compress_to_buffer(rows, &mut out).map_err(|e| ParquetError::General(format!("zstd: {e}")))?;
    let header = data_page_header(rows.len(), compressed, n)?;
    if header.len() < slot {
        // (A smaller number never needs a longer varint, so the header is never longer than its slot.)
        chunk.copy_within(start + slot.., start + header.len());
        chunk.truncate(start + header.len() + compressed);
    }
    chunk[start..start + header.len()].copy_from_slice(&header);
    asm.offsets.append_offset_and_size(start as i64, (header.len() + compressed) as i32);
    asm.offsets.append_row_count(n as i64);
    asm.uncompressed += (header.len() + rows.len()) as u64;
    asm.rows += n as u64;
    Ok(())
}

/// The Thrift (compact protocol) `PageHeader` of a version-1 data page: PLAIN values, RLE level encodings (none
/// present: the column is required and flat), no statistics, no CRC. Field by field from parquet.thrift:
/// `PageHeader { 1: type, 2: uncompressed_page_size, 3: compressed_page_size, 5: data_page_header }` and
/// `DataPageHeader { 1: num_values, 2: encoding, 3: definition_level_encoding, 4: repetition_level_encoding }`.
fn data_page_header(uncompressed: usize, compressed: usize, rows: usize) -> Result<Vec<u8>> {
    let int = |v: usize, what: &str| {
        i32::try_from(v).map_err(|_| ParquetError::General(format!("a data page's {what} ({v}) exceeds i32")))
    };
    const I32: u8 = 5; // compact-protocol type ids
    const STRUCT: u8 = 12;
    const DATA_PAGE: i32 = 0; // PageType
    const PLAIN: i32 = 0; // Encoding
    const RLE: i32 = 3;
    let mut out = Vec::with_capacity(32);
    let field = |out: &mut Vec<u8>, delta: u8, ty: u8| out.push(delta << 4 | ty);
    let i32v = |out: &mut Vec<u8>, v: i32| {
        let mut z = ((v << 1) ^ (v >> 31)) as u32; // zigzag, then unsigned LEB128
        while z >= 0x80 {
            out.push(z as u8 | 0x80);
            z >>= 7;
        }
        out.push(z as u8);
    };
    field(&mut out, 1, I32);
    i32v(&mut out, DATA_PAGE);
    field(&mut out, 1, I32);
    i32v(&mut out, int(uncompressed, "uncompressed size")?);
    field(&mut out, 1, I32);
    i32v(&mut out, int(compressed, "compressed size")?);
    field(&mut out, 2, STRUCT); // field 5, after field 3
    field(&mut out, 1, I32);
    i32v(&mut out, int(rows, "value count")?);
    field(&mut out, 1, I32);
    i32v(&mut out, PLAIN);
    field(&mut out, 1, I32);
    i32v(&mut out, RLE);
    field(&mut out, 1, I32);
    i32v(&mut out, RLE);
    out.push(0); // end of DataPageHeader
    out.push(0); // end of PageHeader
    Ok(out)
}

/// A finished chunk, readable by the file writer's splice (`SerializedRowGroupWriter::append_column`).
pub(crate) struct ChunkSlice<'a>(&'a [u8]);

impl Length for ChunkSlice<'_> {
    fn len(&self) -> u64 {
        self.0.len() as u64
    }
}

impl<'a> ChunkReader for ChunkSlice<'a> {
    type T = &'a [u8];

    fn get_read(&self, start: u64) -> Result<&'a [u8]> {
        self.0.get(start as usize..).ok_or_else(|| ParquetError::EOF(format!("offset {start} past the chunk")))
    }

    fn get_bytes(&self, start: u64, length: usize) -> Result<Bytes> {
        let mut out = vec![0; length];
        self.get_read(start)?.read_exact(&mut out)?;
        Ok(out.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_headers_use_the_compact_protocol() {
        // Small sizes: one varint byte each (zigzag doubles them).
        assert_eq!(
            data_page_header(100, 60, 5).unwrap(),
            vec![0x15, 0x00, 0x15, 200, 0x01, 0x15, 120, 0x2c, 0x15, 10, 0x15, 0x00, 0x15, 6, 0x15, 6, 0, 0]
        );
        // 1 MiB: zigzag 2^21 → three LEB128 bytes.
        let h = data_page_header(1 << 20, 1, 1).unwrap();
        assert_eq!(&h[2..7], &[0x15, 0x80, 0x80, 0x80, 0x01]);
        assert!(data_page_header(1 << 31, 1, 1).unwrap_err().to_string().contains("uncompressed size"));
    }
}
