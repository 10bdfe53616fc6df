"""What the onnxruntime reference scripts share: a model's tokenizer with neither padding nor
truncation, and a one-thread CPU session of a model file (the answers inferd must match)."""

import onnxruntime as ort
from tokenizers import Tokenizer


def whole_tokenizer(path):
    """The tokenizer.json at `path`, encoding every token of a text, unpadded."""
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def one_thread_session(path):
    """onnxruntime's CPU session of the ONNX file at `path`, on one thread."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
