/*
 * The layouts of decode_layer.h's structs as this compiler lays them out: every struct's
 * size and, per field in declaration order, its name, offset and size. kernels/cpu_layout.py
 * mirrors the structs as ctypes.Structure classes and tests/model/test_c_layout.py checks
 * the mirror against this table, so a field added, moved or retyped on one side only fails
 * a test instead of reading the wrong pointer.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "decode_layer.h"

typedef struct {
    const char *name;
    int64_t offset, size;
} layout_field;

#define FIELD(type, field) \
    {#field, (int64_t)offsetof(type, field), (int64_t)sizeof(((type *)0)->field)}

static const layout_field proj_part_fields[] = {
    FIELD(proj_part, data), FIELD(proj_part, scales), FIELD(proj_part, rows),
    FIELD(proj_part, fmt),
};

static const layout_field proj_weight_fields[] = {
    FIELD(proj_weight, parts), FIELD(proj_weight, num_parts),
};

static const layout_field decode_layer_fields[] = {
    FIELD(decode_layer, input_norm), FIELD(decode_layer, qkv),
    FIELD(decode_layer, qkv_bias),   FIELD(decode_layer, q_norm),
    FIELD(decode_layer, k_norm),     FIELD(decode_layer, o),
    FIELD(decode_layer, post_norm),  FIELD(decode_layer, gate_up),
    FIELD(decode_layer, down),       FIELD(decode_layer, kv_cache),
};

static const layout_field lora_proj_fields[] = {
    FIELD(lora_proj, a), FIELD(lora_proj, bt), FIELD(lora_proj, ranks),
};

static const layout_field lora_layer_fields[] = {
    FIELD(lora_layer, qkv), FIELD(lora_layer, o), FIELD(lora_layer, gate_up),
    FIELD(lora_layer, down),
};

static const layout_field decode_step_fields[] = {
    FIELD(decode_step, layers),       FIELD(decode_step, num_layers),
    FIELD(decode_step, final_norm),   FIELD(decode_step, hidden),
    FIELD(decode_step, num_heads),    FIELD(decode_step, num_kv_heads),
    FIELD(decode_step, head_dim),     FIELD(decode_step, intermediate),
    FIELD(decode_step, eps),          FIELD(decode_step, scale),
    FIELD(decode_step, cos_table),    FIELD(decode_step, sin_table),
    FIELD(decode_step, num_threads),  FIELD(decode_step, kv_bf16),
    FIELD(decode_step, x),            FIELD(decode_step, num_tokens),
    FIELD(decode_step, positions),    FIELD(decode_step, slot_mapping),
    FIELD(decode_step, block_tables), FIELD(decode_step, table_stride),
    FIELD(decode_step, seq_lens),     FIELD(decode_step, num_blocks),
    FIELD(decode_step, block_size),   FIELD(decode_step, aux),
    FIELD(decode_step, aux_layers),   FIELD(decode_step, num_aux),
    FIELD(decode_step, lora),         FIELD(decode_step, token_slots),
    FIELD(decode_step, lora_rank),    FIELD(decode_step, lora_bf16),
    FIELD(decode_step, eagle_hidden), FIELD(decode_step, eagle_hidden_norm),
    FIELD(decode_step, eagle_norm_before_residual),
    FIELD(decode_step, tree_src),     FIELD(decode_step, tree_dst),
    FIELD(decode_step, num_tree_copies),
};

#define STRUCT(type) {#type, (int64_t)sizeof(type), type##_fields, \
                      (int64_t)(sizeof(type##_fields) / sizeof(layout_field))}

static const struct {
    const char *name;
    int64_t size;
    const layout_field *fields;
    int64_t num_fields;
} layouts[] = {STRUCT(proj_part),  STRUCT(proj_weight), STRUCT(decode_layer),
               STRUCT(lora_proj),  STRUCT(lora_layer),  STRUCT(decode_step)};

/* Struct `name`'s field table into *fields and its size into *size; returns the number of
 * fields, or -1 for a name this table lacks. */
int64_t c_struct_layout(const char *name, const layout_field **fields, int64_t *size) {
    for (size_t i = 0; i < sizeof(layouts) / sizeof(layouts[0]); i++)
        if (strcmp(layouts[i].name, name) == 0) {
            *fields = layouts[i].fields;
            *size = layouts[i].size;
            return layouts[i].num_fields;
        }
    return -1;
}

/* decode_layer.h's LORA_LAYER_POINTERS, the width of the LoRA pointer table. */
int64_t lora_layer_pointers(void) { return LORA_LAYER_POINTERS; }

/* decode_layer.h's PROJ_MAX_PARTS, the length of proj_weight's parts. */
int64_t proj_max_parts(void) { return PROJ_MAX_PARTS; }
