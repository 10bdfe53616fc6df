//! BYTES elements in and out of ONNX Runtime's string tensors as raw bytes: Triton's BYTES are
//! byte strings, and may hold any byte, NUL included. ort 2.0.0-rc.15 goes through C strings
//! (`FillStringTensor`, cut at a NUL, refused by `CString::new`) and UTF-8 `String`s; the C
//! API's sized element buffers (`GetResizedStringTensorElementBuffer`) and its content with
//! offsets (`GetStringTensorContent`) take and give any bytes.

use ort::value::DynValue;
use ort::AsPointer;

/// A C API call's status as a result (the status released once its message is read).
///
/// # Safety
/// `status` is what a C API call just returned, not yet released.
unsafe fn check(status: ort::sys::OrtStatusPtr) -> ort::Result<()> {
    if status.0.is_null() {
        return Ok(());
    }
    let api = ort::api();
    let message = std::ffi::CStr::from_ptr((api.GetErrorMessage)(status.0)).to_string_lossy().into_owned();
    (api.ReleaseStatus)(status.0);
    Err(ort::Error::new(message))
}

/// A string tensor of `shape` holding `items`, byte for byte.
pub fn to_ort(shape: Vec<i64>, items: &[Vec<u8>]) -> ort::Result<DynValue> {
    // Made of empty strings (no NUL to refuse), then each element written at its length.
    let empty = vec![""; items.len()];
    let mut value = ort::value::Tensor::from_string_array((shape, empty.as_slice()))?.into_dyn();
    let api = ort::api();
    for (index, item) in items.iter().enumerate() {
        let mut buffer: *mut std::ffi::c_char = std::ptr::null_mut();
        // SAFETY: `value` is a string tensor of `items.len()` elements; the buffer ORT returns
        // for element `index` holds `item.len()` bytes and is written before the next call.
        unsafe {
            check((api.GetResizedStringTensorElementBuffer)(value.ptr_mut(), index, item.len(), &mut buffer))?;
            if !item.is_empty() {
                std::ptr::copy_nonoverlapping(item.as_ptr(), buffer.cast::<u8>(), item.len());
            }
        }
    }
    Ok(value)
}

/// A string tensor's elements, byte for byte.
pub fn from_ort(value: &DynValue, count: usize) -> ort::Result<Vec<Vec<u8>>> {
    let api = ort::api();
    let mut total = 0usize;
    // SAFETY: `value` is a string tensor of `count` elements: ORT writes `total` bytes of
    // content and one offset per element into buffers of those sizes.
    let (content, mut offsets) = unsafe {
        check((api.GetStringTensorDataLength)(value.ptr(), &mut total))?;
        let mut content = vec![0u8; total];
        let mut offsets = vec![0usize; count + 1];
        check((api.GetStringTensorContent)(
            value.ptr(),
            content.as_mut_ptr().cast(),
            total,
            offsets.as_mut_ptr(),
            count,
        ))?;
        (content, offsets)
    };
    offsets[count] = total;
    offsets
        .windows(2)
        .map(|w| {
            content.get(w[0]..w[1]).map(<[u8]>::to_vec).ok_or_else(|| ort::Error::new("string offsets out of order"))
        })
        .collect()
}
