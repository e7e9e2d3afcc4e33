"""The three tasks: a thin LightningModule each (lm.py, mt.py, algo.py) and the job that
trains and evaluates it (lm_job.py, mt_job.py, algo_job.py)."""
