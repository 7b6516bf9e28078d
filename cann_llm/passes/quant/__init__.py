"""Weight quantization: its settings, arithmetic, calibration, clipping search and the passes that rewrite MatMuls."""
