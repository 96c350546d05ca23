"""Weight and KV-cache quantisation formats and modules, a layer below the model: reference
formats (formats), quantised Linear drop-ins (linear), SmoothQuant factors (smooth) and the
KV-cache format (kv). The pass that applies them to a model is engine/model/quantize.py."""
