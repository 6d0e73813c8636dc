"""The media room: uploads decoded and sized with OpenCV — `images` (limits, EXIF orientation,
the pixel budget) and `video` (frames sampled by time). Imports only the basic top-level modules.
"""
