"""The media room: uploads decoded with OpenCV and sized bit for bit as transformers' processors
size them — `images` (limits, EXIF orientation, the pixel budget, Pillow's resize) and `video` (frames
sampled by time, torch's resize); `drawing`: boxes and points drawn over a picture (the CLI's `chat
--boxes`). Imports only the basic top-level modules.
"""
