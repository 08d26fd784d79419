# Version comparison for the shell scripts (sourced by scripts/setup.sh; no Python packages needed).
#
# version_ge A B: success when version A >= version B, compared as dotted integers, so 2.13.0 >= 2.5
# (a string comparison says otherwise). A local tag (+cpu, +cu121) is ignored, missing parts count as 0
# (2.5 = 2.5.0) and each part's leading digits are its value (2.6.0rc1 counts as 2.6.0).
version_ge() {
    local -a a b
    local i x y
    IFS=. read -r -a a <<< "${1%%+*}"
    IFS=. read -r -a b <<< "${2%%+*}"
    for (( i = 0; i < ${#a[@]} || i < ${#b[@]}; i++ )); do
        x=${a[i]:-0}; y=${b[i]:-0}
        x=${x%%[!0-9]*}; y=${y%%[!0-9]*}
        x=$(( 10#${x:-0} )); y=$(( 10#${y:-0} ))
        if (( x != y )); then return $(( x > y ? 0 : 1 )); fi
    done
    return 0
}
