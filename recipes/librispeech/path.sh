# Environment for the recipe (sourced by run.sh; source it yourself to run single stages by hand).
# Makes the west checkout importable without `pip install -e .` and puts its venv first on PATH.
_west_repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export PYTHONPATH=$_west_repo${PYTHONPATH:+:$PYTHONPATH}
[ -d "$_west_repo/.venv/bin" ] && export PATH=$_west_repo/.venv/bin:$PATH
export PYTHONIOENCODING=UTF-8
export TOKENIZERS_PARALLELISM=false
unset _west_repo
