"""The vision room: pictures and video frames into features for the text decoder.

`features.VisionFeatures` (what the caches keep and the forward takes), `steps` (the torch
tower one block per scheduler step), `encoders` (the backend choice), `onnx` (the ONNX Runtime
export and its sessions). May import quant and the basic top-level modules.
"""
