//! The binary tensor extension's decoder, every datatype: the first byte picks the type, the
//! next eight the element count the header claimed.
#![no_main]

use inferd_worker::runtime::tensor::DataType;

const TYPES: [&str; 14] = [
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64", "BF16",
    "BYTES",
];

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let (Some(&kind), Some(count)) = (data.first(), data.get(1..9)) else { return };
    let Some(dtype) = DataType::from_name(TYPES[kind as usize % TYPES.len()]) else { return };
    let count = u64::from_le_bytes(count.try_into().expect("8 bytes")) as usize;
    if let Ok(tensor) = dtype.parse_binary(&data[9..], count) {
        assert_eq!(tensor.len(), count);
    }
});
