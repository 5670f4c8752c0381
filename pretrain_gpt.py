r"""MindSpeed-LLM's `pretrain_gpt.py`, for its example scripts under msrun (ms_llm/mindspeed/entry.py):
    msrun --worker_num N --local_worker_num N --master_port P --log_dir LOGS --join True \
        /path/to/ms-llm/pretrain_gpt.py <the script's flags, unchanged>
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # this checkout's ms_llm

from ms_llm.cli import run_command  # noqa: E402
from ms_llm.mindspeed.entry import main  # noqa: E402

if __name__ == "__main__":
    # a device that cannot be used: one line and exit code 2, as every ms-llm command
    sys.exit(run_command(lambda: main(entry="pretrain_gpt.py"), prefix="pretrain_gpt.py: "))
