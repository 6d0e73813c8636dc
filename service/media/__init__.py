"""The media room: uploads decoded and sized with OpenCV — `images` (limits, EXIF orientation,
the pixel budget) and `video` (frames sampled by time); `drawing`: boxes and points drawn over a
picture (the CLI's `chat --boxes`). Imports only the basic top-level modules.
"""
