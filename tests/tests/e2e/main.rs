//! End-to-end tests: real etcd processes, real proxy processes, the SDK and lockctl.
//!
//! Run with `make test`. Without an `etcd` on PATH every test reports itself ignored
//! (skipped), never passed; so do the audit store tests without their server
//! (clickhouse-server, moto), which `make setup` installs when it can.

mod admin;
mod audit;
mod audit_stores;
mod auth_tokens;
mod bad_input;
mod cancels;
mod cell;
mod chaos;
mod check_config;
mod client_suites;
mod contention;
mod dev;
mod elections;
mod etcd_api;
mod faults;
mod grants;
mod guide;
mod handover;
mod holds;
mod image;
mod kv;
mod limits;
mod locks;
mod members;
mod memory_store;
mod modes;
mod operations;
mod operations_doc;
mod overhead;
mod rbac;
mod reads;
mod safety;
mod security;
mod sessions;
mod shardmap;
mod support;
mod watches;

use libtest_mimic::{Arguments, Trial};

/// Each test by its path, which is also its name.
macro_rules! trials {
    ($($module:ident :: $test:ident),* $(,)?) => {
        vec![$(support::trial(concat!(stringify!($module), "::", stringify!($test)), $module::$test)),*]
    };
}

fn main() {
    let args = Arguments::from_args();
    let skip = !lockcell_tests::etcd::available();
    if skip {
        eprintln!(
            "e2e: skipped: no `etcd` on PATH; install the etcd-server package (`make setup`) to run these tests"
        );
    }
    let trials: Vec<Trial> = trials![
        sessions::thousand_sessions_use_k_leases_and_write_nothing,
        locks::a_client_shut_down_as_main_returns_leaves_nothing_held,
        locks::release_markers_do_not_pile_up,
        locks::holder_that_stops_renewing_loses_its_lock,
        locks::two_clients_hammering_one_lock_are_fenced,
        locks::retried_acquire_and_release_are_idempotent,
        locks::a_lost_acquire_reply_and_its_retry_make_one_grant,
        overhead::a_wait_for_a_holder_is_not_the_proxys_own_time,
        overhead::a_withdrawn_wait_is_not_the_proxys_own_time,
        safety::a_dropped_guard_and_the_next_acquire_never_share_a_grant,
        safety::a_second_acquire_of_a_held_lock_is_refused_by_name,
        safety::a_grant_etcd_applied_after_the_deadline_is_still_the_sessions,
        safety::a_waiter_rides_out_grant_attempts_etcd_does_not_answer,
        safety::an_enqueue_etcd_applied_after_the_deadline_leaves_no_waiter_in_line,
        safety::an_ephemeral_write_etcd_applied_after_the_deadline_is_still_the_sessions,
        safety::a_waiter_whose_call_ended_while_etcd_was_away_leaves_the_line_when_it_is_back,
        safety::a_waiter_that_hung_up_during_its_enqueue_leaves_no_key_in_line,
        safety::a_grant_from_the_proxy_a_session_is_leaving_never_counts_as_settled,
        safety::a_second_call_is_refused_at_once_in_line_and_in_the_other_mode,
        safety::a_resume_naming_another_sessions_grant_moves_nothing,
        safety::another_session_on_the_same_lease_can_neither_release_nor_take_a_grant,
        safety::concurrent_calls_of_one_session_make_one_grant,
        security::another_identity_cannot_take_over_a_session_by_its_public_id,
        security::a_write_only_identity_never_reads_a_value_through_a_failed_write,
        security::the_admin_drain_answers_only_a_trusted_caller,
        security::one_client_cannot_send_without_bounds,
        limits::one_identity_in_a_loop_is_refused_at_each_limit_and_another_keeps_going,
        limits::calls_past_an_identitys_rate_are_refused_until_it_slows_down,
        limits::etcd_clients_are_refused_at_their_identitys_limits,
        limits::a_cell_near_its_etcd_quota_refuses_new_keys_but_releases_and_expires,
        limits::a_proxy_past_its_memory_bound_sheds_new_sessions_and_watches_only,
        limits::a_vanished_clients_watches_give_their_places_back,
        limits::deleted_keys_stop_counting_and_a_proclaim_counts_its_bytes,
        limits::keepalives_of_leases_not_here_are_paced,
        limits::persistent_keys_count_against_their_writer_across_the_cell,
        limits::a_txn_gathering_leases_is_refused_at_the_sessions_limit,
        limits::a_txn_gathering_leases_is_refused_at_the_keys_limit_before_moving,
        security::one_writer_cannot_grow_every_proxy_past_the_cells_bound,
        security::the_audit_history_answers_only_who_may_read_it,
        security::a_renewed_certificate_applies_without_a_restart,
        contention::two_hundred_waiters_each_get_it_once_at_one_grant_per_proxy,
        contention::two_hundred_waiters_on_a_fair_class_go_in_arrival_order,
        modes::readers_share_and_a_writer_excludes_them,
        modes::a_fair_writer_is_not_starved_by_new_readers,
        modes::class_rules_refuse_a_mode_and_a_ttl,
        modes::a_bad_classes_file_is_refused_and_the_last_good_one_stays,
        modes::lock_delay_holds_back_a_vanished_holders_lock_but_not_a_released_one,
        modes::tries_racing_a_holders_expiry_wait_out_the_lock_delay,
        elections::an_observer_goes_on_through_its_proxys_death,
        elections::one_leader_at_a_time_and_observers_see_every_change_in_order,
        elections::a_leader_whose_session_expires_is_replaced,
        elections::sequencer_checks_and_refusals_name_the_rule,
        faults::killed_proxy_locks_pass_on_after_lease_ttl,
        faults::sigterm_waits_out_holders_validity_then_revokes_its_leases,
        faults::proxy_started_before_etcd_says_so_and_serves_once_it_is_up,
        faults::etcd_away_acquire_unavailable_sessions_end_at_lower_bound,
        faults::lockctl_stops_its_command_when_the_session_passes_its_deadline,
        faults::lockctl_kills_a_command_that_ignores_sigterm_before_the_lock_passes,
        faults::lockctl_stops_every_process_of_a_compound_command,
        faults::lockctl_lets_a_command_wind_down_within_the_grace_before_the_deadline,
        kv::conditional_writes_and_linearizable_reads_across_proxies,
        kv::ephemeral_keys_vanish_with_their_session_and_their_proxy,
        kv::bad_keys_and_values_are_refused_and_write_nothing,
        kv::sdk_membership_keys_go_when_the_session_closes,
        kv::lockctl_get_put_del_with_compare_and_swap,
        kv::a_raced_two_key_move_has_one_winner_and_is_never_half_done,
        kv::bad_transactions_are_refused_by_name_and_write_nothing,
        members::a_member_cache_follows_joins_and_leaves,
        members::members_leave_when_their_session_ends_or_their_proxy_dies,
        members::a_re_announced_member_survives_its_previous_sessions_end,
        reads::a_linearizable_read_through_any_proxy_sees_every_finished_write,
        watches::events_arrive_once_in_order_across_a_proxy_restart_and_a_resume,
        watches::compaction_and_bad_watches_are_reported_by_name,
        watches::a_key_deleted_at_the_compact_revision_where_the_proxy_resumes_stays_deleted,
        watches::a_watch_from_exactly_the_compact_revision_misses_no_delete,
        watches::a_watcher_cut_off_from_its_proxy_for_a_while_misses_nothing,
        watches::a_slow_watcher_is_cut_off_while_a_fast_one_keeps_receiving,
        watches::a_thousand_watchers_over_three_proxies_cost_etcd_at_most_three_watchers,
        bad_input::bad_lock_names_are_refused_with_the_rule,
        bad_input::unknown_and_expired_sessions_are_told_apart,
        dev::make_dev_cell_runs_the_lockctl_example_and_stops_cleanly,
        handover::a_killed_proxys_clients_resume_elsewhere_with_locks_and_tokens_unchanged,
        handover::with_every_proxy_unreachable_a_session_expires_and_its_locks_pass_on,
        handover::a_rolling_restart_of_every_proxy_loses_no_session_and_no_lock,
        handover::a_proxy_cut_off_from_etcd_sends_its_clients_elsewhere_before_its_lease_ends,
        handover::a_resume_the_client_gave_up_on_cannot_land_after_a_later_one,
        handover::a_wait_over_tls_goes_on_after_its_proxy_is_killed,
        handover::every_call_over_tls_to_a_frozen_or_dead_proxy_says_retry,
        handover::a_proxy_that_wakes_after_its_session_left_does_not_end_it,
        handover::a_leave_racing_its_proxys_death_takes_the_member_out,
        handover::a_new_lockctl_passes_over_a_draining_first_proxy,
        handover::a_release_sent_to_a_killed_proxy_releases_where_the_session_went,
        cancels::a_cancelled_acquire_or_campaign_never_leaves_a_grant_without_a_guard,
        cancels::a_given_up_call_never_takes_the_grant_of_another_call_of_its_session,
        holds::revoked_fires_in_jeopardy_and_valid_tells_when_it_passed,
        holds::revoked_says_why_a_hold_was_lost,
        holds::a_lead_loop_keeps_one_term_at_a_time_through_a_proxy_kill,
        chaos::a_fault_run_of_every_kind_breaks_no_rule,
        chaos::a_paused_client_loses_its_lock_and_does_not_act_after_its_deadline,
        chaos::a_clock_within_the_bound_breaks_nothing_and_beyond_it_is_caught,
        cell::a_restore_from_backup_with_a_raised_epoch_keeps_tokens_rising,
        shardmap::two_cells_route_correctly_and_a_prefix_move_never_shows_two_holders,
        shardmap::a_key_deleted_after_a_move_does_not_come_back_when_its_prefix_moves_back,
        shardmap::a_watch_resumed_across_a_prefix_move_ends_rather_than_skip_events,
        shardmap::a_linearizable_read_during_a_move_never_answers_from_the_cell_left,
        shardmap::a_reads_position_carried_across_a_move_is_refused_not_read_in_the_other_cell,
        admin::the_admin_endpoints_answer_and_readyz_goes_unready_when_etcd_is_cut_off,
        admin::the_audit_tailers_readyz_follows_etcd_and_drain_stops_it,
        admin::a_fresh_proxy_exports_every_counter_at_zero,
        operations::lockctl_stops_its_command_when_a_narrowed_grant_loses_the_hold,
        operations::lockctl_stops_its_command_when_an_epoch_bump_loses_the_hold,
        operations::bump_epoch_refuses_a_cell_with_running_proxies,
        operations::one_tailer_per_folder_one_that_cannot_follow_exits_overlaps_refused,
        operations::a_tailer_on_the_trail_of_a_restored_cell_refuses_to_merge_it,
        check_config::check_config_finds_a_bad_file_before_a_restart_does,
        operations::losing_the_etcd_leader_costs_no_lease_and_no_lock,
        client_suites::aetcds_own_suite_passes_against_bare_etcd,
        client_suites::aetcds_own_suite_passes_against_a_proxy,
        etcd_api::etcdctl_reads_and_writes_small_keys_through_a_proxy,
        etcd_api::etcdctl_leases_are_sessions_of_the_proxy,
        etcd_api::etcdctl_logs_in_with_a_grants_token_and_is_held_to_its_grants,
        etcd_api::etcdctl_watches_from_a_revision_with_previous_values,
        etcd_api::lease_ids_are_unique_across_the_proxies_of_a_cell,
        etcd_api::a_key_deleted_or_rewritten_leaves_its_lease,
        etcd_api::writes_past_the_proxys_bound_wait_their_turn_and_land,
        etcd_api::a_leased_put_queued_past_its_revoke_is_refused,
        etcd_api::two_etcdctl_locks_at_once_never_overlap,
        etcd_api::a_lock_wait_given_up_leaves_only_what_it_made,
        etcd_api::a_lock_call_standing_on_a_withdrawn_key_is_refused,
        etcd_api::etcdctl_elect_observers_see_every_leader_in_order,
        etcd_api::a_leased_put_racing_its_revoke_is_all_or_nothing,
        etcd_api::a_drained_proxys_leases_go_on_at_the_next_proxy,
        etcd_api::a_lease_outlives_a_restart_of_its_only_proxy,
        etcd_api::a_write_whose_answer_was_lost_is_handed_over_with_its_lease,
        etcd_api::only_its_owner_takes_a_handed_over_lease,
        etcd_api::the_election_service_elects_one_leader_at_a_time,
        etcd_api::a_watch_that_requires_a_leader_ends_when_the_proxy_is_cut_off,
        etcd_api::a_lease_is_served_at_every_proxy,
        etcd_api::a_forwarded_call_keeps_its_callers_identity,
        etcd_api::calls_racing_a_take_over_find_the_lease,
        etcd_api::a_forwarded_lock_wait_given_up_leaves_nothing_in_line,
        etcd_api::etcds_json_gateway_answers_http_clients,
        etcd_api::gateway_streams_answer_what_they_were_asked,
        etcd_api::etcd_api_watches_are_fanned_out_by_the_proxy,
        etcd_api::etcd_api_progress_never_runs_ahead_of_events,
        etcd_api::a_watch_cancelled_during_its_catch_up_leaves_nothing_behind,
        etcd_api::a_catch_up_in_fragments_delivers_each_revision_whole,
        etcd_api::a_keys_client_lease_shows_at_every_proxy_and_in_lease_compares,
        etcd_api::a_dead_proxys_lease_records_are_swept,
        etcd_api::a_txn_writing_with_leases_of_two_proxies_runs_as_one,
        etcd_api::a_lease_moved_away_and_back_keeps_its_keys,
        etcd_api::calls_racing_moves_of_a_lease_lose_nothing,
        etcd_api::lock_calls_given_up_while_their_lease_moves_leave_nothing_in_line,
        memory_store::the_memory_store_answers_every_request_as_etcd_does,
        operations::a_hold_lost_on_a_move_and_asked_for_again_at_once_waits_out_the_old_deadline,
        operations_doc::the_operations_guides_commands_run_against_a_real_cell,
        operations::an_ended_session_is_refused_by_every_proxy,
        operations::status_reports_a_frozen_member_and_keeps_going,
        operations::audit_events_name_the_sessions_proxy_the_grants_epoch_and_the_writer,
        shardmap::a_moved_keys_history_spans_both_cells_trails_with_the_move_marked,
        guide::the_client_guides_examples_run_against_a_real_cell,
        guide::the_guides_programs_go_on_through_a_proxy_kill,
        grants::prefix_grants_refuse_what_they_should_and_allow_what_they_should,
        grants::a_proxy_reaches_etcd_over_mutual_tls,
        rbac::each_role_can_do_what_it_should_and_nothing_more,
        rbac::auth_enable_changes_nothing_the_second_time_and_puts_back_drift,
        auth_tokens::a_proxy_and_the_audit_tailer_keep_working_after_etcd_forgets_their_tokens,
        audit_stores::clickhouse_store_partitions_by_day_and_replays_without_duplicates,
        audit_stores::archive_on_s3_covers_every_revision_once_per_class,
        audit::the_trail_of_a_scripted_run_is_complete_in_order_and_rebuilt_from_the_archive,
        audit::with_clickhouse_and_s3_the_trail_is_complete_and_rebuilt,
        image::the_images_proxy_serves_a_lock_and_drains_on_sigterm,
    ];
    // Tests that need a server besides etcd: the name they start with, and why they
    // skip when it is missing.
    let mut missing: Vec<(&str, &str)> = Vec::new();
    if !lockcell_tests::clickhouse::available() || !lockcell_tests::s3::available() {
        missing.push((
            "audit::with_clickhouse_and_s3",
            "needs both clickhouse-server and moto_server (`make setup` installs them)",
        ));
    }
    if !lockcell_tests::clickhouse::available() {
        missing.push((
            "audit_stores::clickhouse_",
            "no clickhouse-server; install the clickhouse-server package (`make setup`)",
        ));
    }
    if !lockcell_tests::s3::available() {
        missing.push((
            "audit_stores::archive_on_s3",
            "no moto_server in .lockcell-tools/venv; `make setup` installs moto[server] there",
        ));
    }
    if lockcell_tests::bins::faketime_env(1.0).is_none() {
        missing.push((
            "chaos::a_clock_within",
            "no libfaketime; install the faketime package (`make setup`)",
        ));
    }
    if !lockcell_tests::client_suites::available() {
        missing.push((
            "client_suites::",
            "no aetcd suite in .lockcell-tools (or no etcdctl); `make setup` installs them",
        ));
    }
    if !lockcell_tests::client_suites::etcdctl_available() {
        missing.push((
            "etcd_api::",
            "no etcdctl; install the etcd-client package (`make setup`)",
        ));
    }
    let no_containers = lockcell_tests::image::run_flags().err();
    if let Some(why) = &no_containers {
        missing.push(("image::", why));
    }
    for (prefix, why) in &missing {
        eprintln!("e2e: skipped {prefix}*: {why}");
    }
    let trials = trials
        .into_iter()
        .map(|t| {
            let needs_missing = missing
                .iter()
                .any(|(prefix, _)| t.name().starts_with(prefix));
            t.with_ignored_flag(skip || needs_missing)
        })
        .collect();
    libtest_mimic::run(&args, trials).exit();
}
