# Kaldi-style command-line options for recipe scripts. Source it; do not run it.
#
#   stage=0              # every option is a shell variable set BEFORE sourcing
#   aishell_dir=
#   shards=false
#   . tools/parse_options.sh || exit 1
#   # options are consumed; positional arguments are left in "$@"
#
# --name VALUE and --name=VALUE set $name ('-' in a name becomes '_', so --stop-stage
# also sets $stop_stage). An option without a variable of that name is an error, and a
# variable whose current value is true or false only accepts true or false.
# --help or -h prints the calling script's header comment (its leading '#' lines after
# the '#!' line) and exits 0. Parsing stops at '--' or at the first argument that does
# not start with '--'.

_po_help() {
  awk 'NR == 1 && /^#!/ { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"
}

_po_fail() {
  echo "$(basename "$0"): $*" >&2
  echo "$(basename "$0"): run with --help for the options" >&2
}

while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) _po_help; exit 0 ;;
    --) shift; break ;;
    --*=*) _po_name=${1%%=*}; _po_value=${1#*=}; _po_n=1 ;;
    --?*)
      if [ $# -lt 2 ]; then _po_fail "option $1 needs a value"; return 1; fi
      _po_name=$1; _po_value=$2; _po_n=2 ;;
    *) break ;;
  esac
  _po_name=${_po_name#--}
  _po_name=${_po_name//-/_}
  if ! [[ $_po_name =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || ! declare -p "$_po_name" >/dev/null 2>&1; then
    _po_fail "unknown option --${_po_name}"
    return 1
  fi
  _po_old=${!_po_name}
  if [[ $_po_old == true || $_po_old == false ]] && [[ $_po_value != true && $_po_value != false ]]; then
    _po_fail "--${_po_name} takes true or false, got '${_po_value}'"
    return 1
  fi
  printf -v "$_po_name" '%s' "$_po_value"
  shift "$_po_n"
done
unset _po_name _po_value _po_n _po_old
true
