"""How many JPEGs a second each GPU decoder makes of an image folder's files held in memory, alone
(no model, no resize): torchvision's batched `decode_jpeg(..., device="cuda")` (nvJPEG, as
`loader=gpu_decode` calls it) from 1, 2 and 4 host threads, each decoding whole batches on its own
stream; and NVIDIA's nvImageCodec (`nvidia-nvimgcodec-cu13`, with `nvidia-nvjpeg`), where it is
installed, with its default backends and with the hardware JPEG decoder only. Wall time over
`--batches` batches after two of warm-up, the device synchronised at both ends. And how much of a
second of Python work another thread gets done while torchvision's decoder runs (1.0: the decoder
releases the GIL; the loop's thread launches the step's kernels beside it).

    python benchmarks/jpeg_decoders.py outputs/generated-data/images-224-8192 --batch 128
"""
import argparse
import glob
import os
import threading
import time

import torch
from torchvision.io import ImageReadMode, decode_jpeg


def rate(decode_batch, batches, threads=1):
    """Images a second decoding `batches` (lists of uint8 tensors) with `threads` threads."""
    for b in batches[:2]:
        decode_batch(b)  # warm-up: decoders made, memory pools grown
    torch.cuda.synchronize()
    todo = list(range(2, len(batches)))
    lock = threading.Lock()

    def work():
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            while True:
                with lock:
                    if not todo:
                        break
                    i = todo.pop()
                decode_batch(batches[i])
        stream.synchronize()

    start = time.perf_counter()
    pool = [threading.Thread(target=work) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    torch.cuda.synchronize()
    return sum(len(b) for b in batches[2:]) / (time.perf_counter() - start)


def python_share(decode_batch, batches, seconds=1.0):
    """Python loop iterations per second on this thread while another decodes without pause,
    over the same alone."""
    def spin():
        n, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            n += 1
        return n

    alone = spin()
    stop = threading.Event()

    def decode():
        while not stop.is_set():
            for b in batches:
                decode_batch(b)
        torch.cuda.synchronize()

    thread = threading.Thread(target=decode)
    thread.start()
    time.sleep(0.2)
    beside = spin()
    stop.set()
    thread.join()
    return beside / alone


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--batches", type=int, default=40)
    args = p.parse_args()
    files = sorted(glob.glob(os.path.join(args.folder, "*", "*.jpg")))[:args.batch * args.batches]
    data = [open(f, "rb").read() for f in files]
    tensors = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in data]
    batches = [tensors[i:i + args.batch] for i in range(0, len(tensors), args.batch)]
    print(f"{torch.cuda.get_device_name()}: {len(files)} JPEGs of {args.folder}, "
          f"{sum(map(len, data)) / len(data) / 1e3:.1f} kB each, batches of {args.batch}")
    torchvision = lambda b: decode_jpeg(b, mode=ImageReadMode.RGB, device="cuda")
    for threads in (1, 2, 4):
        try:
            print(f"torchvision decode_jpeg, {threads} thread(s): {rate(torchvision, batches, threads):,.0f} images/s")
        except Exception as e:
            print(f"torchvision decode_jpeg, {threads} thread(s): failed ({type(e).__name__}: {str(e)[:200]})")
    print(f"Python work on another thread beside torchvision's decoder: {python_share(torchvision, batches[:8]):.2f} "
          f"of its pace alone")
    try:
        from nvidia import nvimgcodec
    except Exception as e:
        print(f"nvImageCodec: not available ({type(e).__name__}: {str(e)[:200]})")
        return
    raw = [data[i:i + args.batch] for i in range(0, len(data), args.batch)]
    kinds = {"default backends": None}
    for name in ("HW_GPU_ONLY", "GPU_ONLY"):
        kind = getattr(getattr(nvimgcodec, "BackendKind", nvimgcodec), name, None)
        if kind is not None:
            kinds[name] = kind
    for label, kind in kinds.items():
        try:
            decoder = (nvimgcodec.Decoder() if kind is None else
                       nvimgcodec.Decoder(backends=[nvimgcodec.Backend(kind)]))
            def to_torch(b):
                images = decoder.decode(b)
                missing = sum(image is None for image in images)
                if missing:
                    raise RuntimeError(f"{missing} of {len(b)} images not decoded")
                return [torch.as_tensor(image, device="cuda") for image in images]
            for threads in (1,):
                print(f"nvImageCodec {nvimgcodec.__version__} {label}, {threads} thread(s): "
                      f"{rate(to_torch, raw, threads):,.0f} images/s")
        except Exception as e:
            print(f"nvImageCodec {label}: failed ({type(e).__name__}: {' '.join(str(e).split())[:200]})")


if __name__ == "__main__":
    main()
