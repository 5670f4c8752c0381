"""ms-llm's own distributed, reshardable training checkpoint: ``dcp`` is its public face
(saving in ``save``, finding the newest complete one in ``discovery``, reading in ``load``, the
names and pieces they share in ``format``), and ``export`` writes one as a Hugging Face or
Megatron folder."""
