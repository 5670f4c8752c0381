"""Pipeline parallelism: the model cut into stages (``stages``), schedules as per-rank action
lists with one record per schedule (``schedules/``), and the one executor that runs any of them
(``executor``)."""
