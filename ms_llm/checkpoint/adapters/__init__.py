"""LoRA adapters as files: ``merge`` reads them (a training checkpoint or a PEFT folder) and
merges them into a converter source; ``export`` writes a LoRA training checkpoint merged or as
PEFT adapters."""
