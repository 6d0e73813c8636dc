"""A picture or a clip in few bytes that give back the very pixels the model saw: a lossless PNG of the
pixels — or, for a picture, the bytes the client sent where they are fewer and decode (with the limits
they were decoded with) to the same pixels. Either way the pixels' digest is checked when they are read
back: a conversation continued on another machine sees the same bits, or the read fails loudly."""

from __future__ import annotations

from dataclasses import asdict, replace

import cv2
import numpy as np

from ..caches.lru import BudgetedLRU
from ..media.images import DecodedImage, ImageLimits, decode_image, image_digest
from ..media.video import DecodedVideo, video_digest

PNG_LEVEL = 6  # zlib's default: a 448² picture in ~15 ms, once (`Pictures` remembers it by digest)


class PictureMismatch(ValueError):
    """Stored bytes that do not give back the pixels they were stored for."""


def _png(pixels: np.ndarray) -> bytes:
    ok, png = cv2.imencode(".png", cv2.cvtColor(pixels, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_PNG_COMPRESSION, PNG_LEVEL])
    assert ok, "OpenCV could not write a PNG of RGB uint8 pixels"
    return png.tobytes()


def _unpng(data: bytes) -> np.ndarray:
    bgr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    if bgr is None:
        raise PictureMismatch("a stored picture is not a PNG")
    return np.ascontiguousarray(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB))


class Pictures:
    """Pictures and clips to and from their stored form; what each was stored as is remembered by its
    digest (up to `max_bytes`), so a conversation written again each turn encodes each picture once."""

    def __init__(self, max_bytes: int = 64 * 1024**2):
        self._encoded: BudgetedLRU[tuple[dict, bytes]] = BudgetedLRU("stored_pictures", max_bytes, 4096, 3600)

    def image(self, image: DecodedImage) -> tuple[dict, bytes]:
        """(what the bytes are, the bytes) of a picture."""
        known = self._encoded.get("i" + image.digest)
        if known is not None:
            return known
        meta = {
            "source_format": image.source_format,
            "source_size": list(image.source_size),
            "oriented_size": list(image.oriented_size) if image.oriented_size else None,
            "digest": image.digest,
        }
        data, meta["form"] = _png(image.pixels), "png"
        if image.sent is not None and image.limits is not None and len(image.sent) < len(data):
            if decode_image(image.sent, image.limits).digest == image.digest:
                data, meta["form"], meta["limits"] = image.sent, "sent", asdict(image.limits)
        self._encoded.put("i" + image.digest, (meta, data), len(data))
        return meta, data

    def video(self, video: DecodedVideo) -> tuple[dict, bytes]:
        """(what the bytes are, the bytes) of a clip: its frames one above the other in one PNG."""
        known = self._encoded.get("v" + video.digest)
        if known is not None:
            return known
        frames = video.frames
        meta = {
            "shape": list(frames.shape),
            "frame_indices": list(video.frame_indices),
            "source_fps": video.source_fps,
            "source_format": video.source_format,
            "source_size": list(video.source_size),
            "source_frames": video.source_frames,
            "digest": video.digest,
        }
        data = _png(frames.reshape(-1, *frames.shape[2:]))
        self._encoded.put("v" + video.digest, (meta, data), len(data))
        return meta, data

    def read_image(self, meta: dict, data: bytes) -> DecodedImage:
        """The picture, its pixels checked against its digest (PictureMismatch if they differ)."""
        if meta["form"] == "sent":
            image = decode_image(data, ImageLimits(**meta["limits"]))
        else:
            pixels = _unpng(data)
            oriented = tuple(meta["oriented_size"]) if meta["oriented_size"] else None
            size = tuple(meta["source_size"])
            image = DecodedImage(pixels, meta["source_format"], size, image_digest(pixels), oriented_size=oriented)
        if image.digest != meta["digest"]:
            raise PictureMismatch(f"a stored picture decodes to other pixels than {meta['digest']}")
        image = replace(image, decode_seconds=0.0)
        self._encoded.put("i" + image.digest, (meta, data), len(data))
        return image

    def read_video(self, meta: dict, data: bytes) -> DecodedVideo:
        """The clip, its frames checked against its digest."""
        frames = np.ascontiguousarray(_unpng(data).reshape(meta["shape"]))
        if video_digest(frames) != meta["digest"]:
            raise PictureMismatch(f"a stored clip decodes to other frames than {meta['digest']}")
        self._encoded.put("v" + meta["digest"], (meta, data), len(data))
        return DecodedVideo(
            frames=frames,
            frame_indices=tuple(meta["frame_indices"]),
            source_fps=meta["source_fps"],
            source_format=meta["source_format"],
            source_size=tuple(meta["source_size"]),
            source_frames=meta["source_frames"],
            decode_seconds=0.0,
            digest=meta["digest"],
        )
