//! The metadata columns that hold one value in every row of a partition — run id, hookpoint, site, layer, rank,
//! dtype, shape — written as Parquet column chunks in constant time, whatever the number of rows.
//!
//! Such a column, dictionary-encoded as the generic writer does it, is a dictionary page holding the value and a data
//! page saying "row count times entry 0": one run of the RLE/bit-packed hybrid encoding (bit width 0), after a run of
//! definition levels (all 1) for the nullable layer and of repetition levels (all 0) for the one-element shape list.
//! The generic Arrow column writer reaches the same bytes by building an array of the value repeated, hashing every
//! row into its dictionary and comparing every row for statistics — 7 of the 11 metadata columns, about 3% of the
//! Parquet sink's time (`docs/benchmarks.md`). A null layer has an empty dictionary and definition levels all 0.
//! The chunks match the generic writer's byte for byte in their pages (checked by `tests/export.rs`); their statistics
//! (min = max = the value, null count) go into the column chunk's metadata.

use bytes::Bytes;
use parquet::basic::{Compression, Encoding, PageType};
use parquet::column::writer::ColumnCloseResult;
use parquet::data_type::ByteArray;
use parquet::errors::{ParquetError, Result};
use parquet::file::metadata::{ColumnChunkMetaData, OffsetIndexBuilder, PageEncodingStats};
use parquet::file::statistics::{Statistics, ValueStatistics};
use parquet::schema::types::ColumnDescPtr;

use crate::dataset::Constant;
use crate::writing::pages::{page_header, uleb128, PageKind};

/// The column chunk of `column` holding `value` in each of `rows` rows, uncompressed, and what the file writer needs
/// to know about it (offsets relative to the chunk's start).
pub(crate) fn constant_chunk(
    column: ColumnDescPtr,
    value: Constant<'_>,
    rows: usize,
) -> Result<(Bytes, ColumnCloseResult)> {
    let (max_def, max_rep) = (column.max_def_level(), column.max_rep_level());
    let expected = match value {
        Constant::Str(_) => (0, 0),
        Constant::Int32(_) => (max_def.min(1), 0), // the layer is nullable, the rank is not
        Constant::Int64List(_) => (1, 1),
    };
    if (max_def, max_rep) != expected {
        return Err(ParquetError::General(format!(
            "column {} has levels (def {max_def}, rep {max_rep}), not those of {value:?}",
            column.path()
        )));
    }
    let (plain, statistics): (Option<Vec<u8>>, Statistics) = match value {
        Constant::Str(s) => {
            let mut plain = (s.len() as u32).to_le_bytes().to_vec();
            plain.extend_from_slice(s.as_bytes());
            let v = Some(ByteArray::from(s));
            (Some(plain), ValueStatistics::new(v.clone(), v, None, Some(0), false).into())
        }
        Constant::Int32(Some(v)) => (
            Some(v.to_le_bytes().to_vec()),
            ValueStatistics::new(Some(v), Some(v), None, Some(0), false).with_backwards_compatible_min_max(true).into(),
        ),
        Constant::Int32(None) => (None, ValueStatistics::<i32>::new(None, None, None, Some(rows as u64), false).into()),
        Constant::Int64List(v) => (
            Some(v.to_le_bytes().to_vec()),
            ValueStatistics::new(Some(v), Some(v), None, Some(0), false).with_backwards_compatible_min_max(true).into(),
        ),
    };
    // Levels: a 4-byte length, then one RLE run (bit width 1: the value in one byte).
    let mut body = Vec::with_capacity(32);
    let levels = |body: &mut Vec<u8>, level: u8| {
        let mut run = Vec::with_capacity(8);
        rle_run(&mut run, rows, Some(level));
        body.extend_from_slice(&(run.len() as u32).to_le_bytes());
        body.extend_from_slice(&run);
    };
    if max_rep > 0 {
        levels(&mut body, 0); // each row's list starts a new record
    }
    if max_def > 0 {
        levels(&mut body, u8::from(plain.is_some())); // present (or, for a null layer, absent) in every row
    }
    // The dictionary page: the value (none for a null layer), then the data page's indices, all entry 0.
    let (entries, plain) = match plain {
        Some(plain) => (1, plain),
        None => (0, Vec::new()),
    };
    let dictionary = PageKind::Dictionary { values: entries, encoding: Encoding::PLAIN, sorted: false };
    let mut chunk = page_header(dictionary, plain.len(), plain.len(), crc32fast::hash(&plain))?;
    chunk.extend_from_slice(&plain);
    body.push(0); // bit width of the indices: one entry needs none
    if entries > 0 {
        rle_run(&mut body, rows, None);
    }
    let data_start = chunk.len();
    let encoding = Encoding::RLE_DICTIONARY;
    let data = PageKind::Data { values: rows, encoding, levels: Encoding::RLE };
    chunk.extend(page_header(data, body.len(), body.len(), crc32fast::hash(&body))?);
    chunk.extend_from_slice(&body);
    let mut offsets = OffsetIndexBuilder::new();
    offsets.append_offset_and_size(data_start as i64, (chunk.len() - data_start) as i32);
    offsets.append_row_count(rows as i64);
    let page_stats = vec![
        PageEncodingStats { page_type: PageType::DICTIONARY_PAGE, encoding: Encoding::PLAIN, count: 1 },
        PageEncodingStats { page_type: PageType::DATA_PAGE, encoding, count: 1 },
    ];
    let metadata = ColumnChunkMetaData::builder(column)
        .set_compression(Compression::UNCOMPRESSED)
        .set_encodings(vec![Encoding::PLAIN, Encoding::RLE, encoding])
        .set_page_encoding_stats(page_stats)
        .set_num_values(rows as i64)
        .set_total_compressed_size(chunk.len() as i64)
        .set_total_uncompressed_size(chunk.len() as i64)
        .set_dictionary_page_offset(Some(0))
        .set_data_page_offset(data_start as i64)
        .set_statistics(statistics)
        .build()?;
    let close = ColumnCloseResult {
        bytes_written: chunk.len() as u64,
        rows_written: rows as u64,
        metadata,
        bloom_filter: None,
        column_index: None,
        offset_index: Some(offsets.build()),
    };
    Ok((Bytes::from(chunk), close))
}

/// One run of the RLE/bit-packed hybrid encoding: `count` times `value` (one byte: bit width 1), or with no value
/// bytes at all for bit width 0.
fn rle_run(out: &mut Vec<u8>, count: usize, value: Option<u8>) {
    uleb128(out, (count as u64) << 1); // low bit 0: an RLE run
    out.extend(value);
}
