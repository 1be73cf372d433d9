"""fsdpclip.decode._plain_jpeg_header against PIL's Image.open on JPEG variants and non-JPEGs. `python headers.py`."""
import io, random, numpy as np
from PIL import Image
from fsdpclip.decode import read_header, _plain_jpeg_header
rng = np.random.default_rng(0)
def pic(h, w):
    return Image.fromarray(rng.integers(0, 256, (max(2, h // 8), max(2, w // 8), 3), dtype=np.uint8)).resize((w, h))
def enc(im, fmt="JPEG", **kw):
    out = io.BytesIO(); im.save(out, fmt, **kw); return out.getvalue()
im = pic(37, 53)
cases = {"baseline": enc(im), "progressive": enc(im, progressive=True), "444": enc(im, subsampling=0),
         "gray": enc(im.convert("L")), "cmyk": enc(im.convert("CMYK")), "png": enc(im, "PNG"),
         "exif": enc(im, exif=Image.Exif()), "icc": enc(im, icc_profile=b"x" * 70000), "restart": enc(im, restart_marker_blocks=1) if False else enc(im),
         "optimize": enc(im, optimize=True), "comment": enc(im, comment=b"hello"),
         "mpo": enc(im, "MPO", save_all=True, append_images=[pic(37, 53)]),
         "cut header": enc(im)[:40], "garbage": b"\xff\xd8\xff" + bytes(50), "big": enc(pic(3000, 20))}
for name, data in cases.items():
    fast = _plain_jpeg_header(data)
    try:
        p = Image.open(io.BytesIO(data)); pil = (p.format, p.mode, p.height, p.width, bool(p.info.get("progressive")))
    except Exception as e:
        pil = repr(e)[:40]
    got = None if fast is None else (fast.format, fast.mode, fast.height, fast.width, fast.progressive)
    print(f"{name:12s} fast={got} pil={pil} {'OK' if got is None or got == pil else 'MISMATCH'}")
