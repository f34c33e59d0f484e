"""LoRA: key names, configs, the math, the plan, fusion, and the adapter export."""
