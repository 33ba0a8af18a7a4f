"""SFT data, one stage per module: `formats` (the FORMATS registry: chat template, supervision masks),
`sources` (datasets: hub, files, folders), `packing` (rows, labels, positions), `loader` (the global
seeded stream on StatefulDataLoader), `pipeline` (the stages in order, once per machine). Import
from the stage's module: this package imports none of them, so the config check's look-up of
`formats.FORMATS` does not load `datasets` and torchdata."""
